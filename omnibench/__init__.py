"""omnibench: a benchmark harness for training multimodal LLMs under dynamic workloads.

Importing the package is light (no torch): the CLI, planners and simulator start fast, and only
`omnibench.models` / `omnibench.runtime` pull in torch.
"""

__version__ = "0.1.0"
