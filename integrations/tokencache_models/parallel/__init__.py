"""Tensor parallelism: the rank group and sharded layers, cutting a shard, the runtime."""
