"""The scheduler: which requests run in the next forward, and what their sampled tokens do to them.

Pure Python over ints and lists: nothing here imports torch, so every
scheduling decision is testable with fake sampled ids and no model. The only
thing that touches a device is the model runner (`runtime.runner`), which
this package knows through the `KvLeases` and `StepPlan` seams.
"""
