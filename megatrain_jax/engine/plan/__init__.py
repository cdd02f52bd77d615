"""What a step is and what it needs, before anything runs.

`schedule` (the order of units, groups, fetches and gradients), `ops` (the typed
operations of a step and the device bytes each adds or frees), `program` (a step as
the list of those operations), `slots` (the prefetcher's buffer-slot rules),
`simulate` and `trace` (the program replayed under the modelled timing: the device
peak), `sizes` (the byte rules), `step_plan` and `memory` (a batch shape's plan;
host and device bytes by kind), `workspace` (XLA's scratch inside a layer's call),
`pinned` (pinned host bytes) and `preflight` (the checks that refuse a run that
cannot fit). Nothing here allocates or starts a thread.
"""
