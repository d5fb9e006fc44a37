"""`hdr experiment`: every replay arm trained and evaluated side by side, on the CPU.

What it does, end to end (`pipeline.run_experiment`), for a preset of `ExperimentConfig`
(`configs/experiments/*.yaml`, `config.experiment_config`):

1. data: the wiki-vital corpus and its index under `--data-dir` (built with `hdr index
   prepare-wiki` / `hdr index build` when missing) (`server`);
2. a real `hdr serve` subprocess on a free loopback port over that index, stopped at the end
   (`server`);
3. one SFT start (`hdr sft`'s `run_sft`), cached under the data dir, shared by every arm
   (`sft_start`);
4. each arm x seed is `trainer.loop.train(config)` with dotted overrides on the base config
   (`configs/tiny-cpu.yaml`, `train_configs`): same SFT start, same seeds (so the same prompt
   order), same periodic held-out subset; several at once in worker processes (`runs`);
5. each final model is evaluated by `evaluation.evaluate` on one fixed held-out set of test
   questions of the preset's task, identical for every arm and seed (and the SFT start once);
6. results (`summary`, `report`): per arm Mean@k, Best@k, greedy EM (mean and spread over
   seeds), differences to the reference arms paired on the same questions with seed-level
   intervals, the cost ledger and the wall time split; `results.json`, `results.md` and the
   charts of `evaluation.plots` in the out dir.

The arms (`arms`; the paper's role-aligned baselines in the Search-R1 setting, and the
published GRPO replay rules): `on_policy` (b fresh groups per step), `on_policy_larger` (1.5b
fresh: more environment cost), `replay_recency` (b fresh + r replayed, the r newest, no gate),
`headroom_drift` (b + r, headroom order, L2 drift gate) and the others of the main preset; the
ablations preset sets `headroom_only`, `drift_only` and `headroom_drift_l1` against
`headroom_drift`.

Departures from the paper: a tiny policy and the embedded tasks instead of Qwen2.5-3B on
NQ+HotpotQA; a few hundred held-out questions and a small k, not seven benchmarks at k=32; as
many seeds as the preset lists. The L1 gate's threshold is `tau_l1`, from its own `hdr
calibrate` sweep (the bridge preset sets one); left unset it is sqrt(tau) of the L2 gate's (by
Jensen, mean|d| <= sqrt(mean d^2), so at least as permissive), not a calibrated gate.
Everything is resumable: a finished run (its `final/` and held-out `eval.json`) is reused when
the command is run again with the same out dir, and only when its stored config hash
(`config_hash.json`, `fingerprint`) is that of the config just built; a run or SFT start made
with other settings is refused in one line naming what differs, never silently reused.

The package imports nothing here: `hdr` registers `experiment/cli.py` at start-up, and the
retrieval image runs `hdr` without torch (or scipy's view of it), so the experiment's modules
load only inside its commands (`experiment.config.experiment_config`,
`experiment.pipeline.run_experiment`).
"""
