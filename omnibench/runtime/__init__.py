"""The runtime: launch ranks, execute Plans with real tensors and collectives, record runs.

Importing `omnibench.runtime.launch` and `records` stays torch-free until ranks start; the
executor, parallelize and worker modules import torch.
"""
