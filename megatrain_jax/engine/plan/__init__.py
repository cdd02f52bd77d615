"""What a step is and what it needs, before anything runs.

`schedule` (the order of units, groups, fetches and gradients), `program` (the step
as a list of typed operations), `simulate` (the program replayed under the modelled
timing: the device peak), `sizes` (the byte rules), `memory` (host and device bytes
by kind, `step_plan`), `workspace` (XLA's scratch inside a layer's call), `pinned`
(pinned host bytes) and `preflight` (the checks that refuse a run that cannot fit).
Nothing here allocates or starts a thread.
"""
