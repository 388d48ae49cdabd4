"""rangeprof: tensor-range profiling with IR tracking for INT8 quantization on Apache TVM."""

import os

# On x86 TVM halves the core count for hyper-threading unless told, which leaves one worker on a
# 2-core machine; its pool reads this once, when a thread first runs a parallel kernel.
os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))
