"""Everything that turns prompts into complete groups by driving engines and environments (see modes.py)."""
