"""How a forward runs: the model executor and its CUDA-graph runners (decode, extend)."""
