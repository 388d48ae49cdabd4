"""Quantization parameters from stored statistics (max, percentile, entropy, MSE), or read from
a QDQ model's pairs."""
