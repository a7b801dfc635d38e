"""The engine: the `ContinuousBatcher` handle any thread calls, its one worker thread, and the wiring that
joins the scheduler to the runtime.

It sits above both: the worker drives the scheduler (`schedule()` -> the runner's forward -> `update()`),
and the wiring builds the runner over a loaded model. The server, the deployments and the CLI use the
engine through `ContinuousBatcher`.
"""
