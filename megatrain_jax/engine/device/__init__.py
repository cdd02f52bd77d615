"""The accelerator's side: what moves there, what runs there, and what it holds.

`transport` and `mesh` (how bytes move, to one device or a data-parallel mesh),
`prefetch` (the thread that fetches units into a bounded number of buffers),
`activations` (checkpoints sent to host memory and brought back), `templates` (the
jitted per-unit functions), `residuals` (what a layer's backward keeps from its
forward), `pool` (buffers reused between steps on the CPU backend) and `ledger`
(the bytes the engine holds in device memory).
"""
