"""The host's side: where each unit's state lives and how it is updated.

`flat` (a unit's tree as one flat buffer), `optimizer` (masters, optimizer state and
accumulators, each unit's update), `adamw` (the fused AdamW kernel), `probe`
(whether a transform can run unit by unit), `gradients` (the gradient and optimizer
threads, and the update clock), `copies` (the streaming copies and the resident
units), `state` (snapshots and the interface checkpoints use) and `malloc` (glibc's
mmap threshold).
"""
