"""The one-GPU check (`python3 scripts/gpu_check.py`): each module a group of sections, every section one function
of the device that runs on CUDA and, where the CPU has a twin of the path, on the CPU (CI runs them all in
`--device cpu`: tests/unit/test_gpu_check.py). run.py holds the command line and the JSON."""
