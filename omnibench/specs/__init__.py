"""Typed specs (model, cluster, parallel layout, run): validated once at the edge, trusted inside.

Nothing here imports torch: planners and the simulator use these specs without tensors.
"""
