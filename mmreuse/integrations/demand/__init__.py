"""`DemandScheduler` in parts, one module per job (docs/vllm-plugins.md):

- `scheduler`: vLLM's scheduler with the demand lock around its state-changing methods, and
  the overrides that feed the parts below (imports vLLM: load it only inside vLLM);
- `index_feed`: P's residency index, fed by the block pool's hooks;
- `answers`: demand answers (the `Request` a query makes, its hit, proof and trust), stats, and
  the proofs checked at admission;
- `records`: admission records (what P did with every request);
- `snapshots`: KV snapshots (P's prefix cache as of a KV-event batch);
- `engine_state`: what P's engine holds, read from vLLM's objects (duck-typed, no vLLM import).

What it shares with the encoder cache's plug-in lives beside it, not in it: the ROUTER thread
(`integrations.control`) and held, paced snapshots with the encoder cache's chunks
(`integrations.snapshots`). The parts take the scheduler as a duck-typed `engine` and never
import `scheduler`. Importing this package imports nothing of vLLM.
"""
