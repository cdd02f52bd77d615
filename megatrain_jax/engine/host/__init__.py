"""The host's side: where each unit's state lives and how it is updated.

`flat` (a unit's tree as one flat buffer, trained leaves first), `store` (the
`StateStore` seam: where each unit's master, optimizer state and gradient
accumulator live; `HostStore` keeps them in host RAM), `updaters` (one `UnitUpdater`
class per way of updating: fused AdamW in parts, Optax per unit, clipped, whole
tree), `probe` (which updater a transform gets), `optimizer` (`HostOptimizer`: a
store and an updater, each unit's update), `adamw` (the fused AdamW kernel),
`gradients` (the gradient and optimizer threads, and the update clock), `copies`
(the streaming copies and the resident units), `state` (snapshots and the interface
checkpoints use) and `malloc` (glibc's mmap threshold).
"""
