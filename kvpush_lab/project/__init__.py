"""``kvpush project``: a projection of pull, vLLM push and kvpush TTFT and
TPOT to the published setup (Qwen3-32B, 1P1D, H200 with EFA). A model,
not a measurement; ``docs/projection.md`` says where each number comes
from and where the model disagrees with the published figures.

The model, per request, from the moment the prefill leg reaches prefill:

* **TTFT** = prefill compute + the configuration's critical-path phases:

  - vllm-pull: prefill's answer through the router to decode (a hop);
    half a decode step, waiting for decode's next step; the READ post
    (descriptors x post cost, *inside decode's loop*); the READ, seen at
    the end of the step it was posted in (or half a step after it is done,
    if it takes longer than a step); decode's first step.
  - vllm-push: one prefill scheduler turn before its writer thread sees
    the finished blocks; the WRITE post (on prefill's thread); the wire;
    half a decode step (decode reads the notification in its step); the
    first step.
  - kvpush: KV ready -> WRITE posted (measured); the post (prefill's
    writer thread); the wire; the notification (decode's progress
    thread, measured) or half a decode step, whichever is longer (the
    thread reads it while the step runs); the first step.

* **TPOT** = decode step + stall. The step is memory bound: weights plus
  every running request's KV read from HBM, over the TP ranks, plus a
  fixed overhead. The stall is pull's alone: each request joining decode
  posts its READ inside decode's loop, and ``decode_batch /
  output_tokens`` requests join per step in steady state, so every step
  grows by ``post x decode_batch / output_tokens``.

Three scenarios: contiguous KV (one run: a descriptor per layer and K/V),
fragmented KV (a descriptor per block, layer and K/V, as in the published
18,880), and decode holding the whole prompt in its prefix cache (vLLM
push decodes at once; kvpush skips the prefill leg; pull still prefills).

Modules: ``shape`` (a model's config -> KV bytes, weights, FLOPs,
descriptors), ``inputs`` (every input with its source), ``estimate`` (the
arithmetic), ``compare`` (the published claims), ``report`` (plain data
and JSON), ``render`` (rich), ``cli``.
"""
