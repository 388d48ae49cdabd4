"""rangeprof: tensor-range profiling with IR tracking for INT8 quantization on Apache TVM."""
