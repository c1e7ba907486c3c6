"""When a block copied to the host KV tier is known to be there whole, so that a restarted worker
may resume from it: the contract between the worker's copies and the scheduler's trust.

A plan's offloads run before its step's forward pass, which waits for them; a plan's write-through
copies (blocks cached by the plan, copied as computed) run after its step, beside the next one,
and the forward pass ``LAG`` launches later waits for them (on every rank and stage). So once the
results of ``LAG`` plans that launched a forward pass, all planned after plan N, are back, every
host copy plan N named is complete on every rank; a worker restart keeps those and drops the rest.
"""

LAG = 2
