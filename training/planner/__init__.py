"""The planner: the three rulers (memory, communication, compute) turned into predictions, the
search over layouts, and the advice with its reasons. Pure arithmetic on shapes and measurements
except where a model is counted (anatomy, fit, dryrun: torch on the meta device or a fake process
group), so that `pipeline=plan` answers what-if questions for a 405B model on 16,384 GPUs in seconds.

Where each idea lives, in dependency order (a module imports only those above it):
- shape: a model's Shape, what a sample saves (Activations), Anatomy; the bytes of a precision.
- pipeline: a schedule's bubble and microbatches in flight, in closed form.
- workload: one setting as predicted (Workload; strategy_workload builds a run's); feasible.
- memory: ruler 1, one rank's peak term by term (memory_breakdown).
- comm: ruler 2, the collectives a step issues and their time per tier (comm_time).
- hardware: what the predictions run on, measured or a preset (Hardware).
- step: a step's time from its parts (step_time).
- calibration: earlier runs' measured steps refine the components (fit_calibration).
- predict: the public entry for one layout, `predict_layout` (evaluate a layout: step time,
  throughput, memory, efficiency).
- counting: FLOPs counted on the meta device, attention and dropout as fused kernels run them.
- anatomy: a model counted from the built module (FLOPs, saved bytes, shape), on the meta device.
- fit: does a model fit one device, and the smallest layout that holds it.
- dryrun: a layout at production scale on a fake process group, counted from the real sharded model.
- space: what the search may choose from: settings (Variant), layouts, batch splits, pipelines.
- ranking: a Candidate (a point of the space as predicted), how candidates rank and read.
- search: the public entry for the space, `search` (every layout and knob, ranked).
- reasons: the advice's reasons, in the seeds' terms (which ruler decided against each strategy).
- advice: the plan's inputs (PlanInputs) read into a search set up from a run's measurements or a
  described cluster, the run's own layout predicted the same way, the scaling curves, the reasons.
"""
