"""The fake-tensor tracer: one step on fake tensors, every storage recorded."""
