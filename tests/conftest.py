import os

# Tests run several ranks on two cores: keep each process to its share of threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
