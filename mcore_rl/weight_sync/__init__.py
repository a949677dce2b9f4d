"""The actor -> engine weight sync, one home (docs/architecture.md, "Weight sync").

The device path, which every engine and placement takes:
  exporter.py     `HFExporter`: this rank's Megatron shards out as full Hugging Face tensors, batch by batch, each
                  gathered shard placed (placement.py, row_plan.py) and moved by one transport, chosen once
  collective.py   `CollectiveGather`: torch.distributed.all_gather over NCCL / HCCL (the devices' transport)
  buckets.py      `sync_weights`: the export streamed in buckets into `RolloutEngine.load_weights`
  receiver.py     `WeightReceiver`: what an engine offers a sync (EngineCapabilities.receiver)

The CPU-only transports, plug-ins the engine's receiver picks (`HFExporter.transport_for`, never by probing):
  shm_gather.py   `SharedMemoryGather`: the gathers through shared segments (copy-in engines, in-place buffers)
  in_place.py     `InPlaceTargets`: a gathered tensor straight into the engine's own tensor (`receiver.buffer`)
  direct_write.py `DirectWrite`: every rank writes its shards into the engines' shared regions (`receiver.shared`)

The separate placement:
  bridge.py       the buckets over the bridge to every rollout replica (`RemoteEngine`'s weight methods)

The verification and the run's object:
  verify.py       probe, tolerance, log-prob gap, fingerprints check, worst tensors, rebuild fallback
  fingerprints.py the positions both sides sample for the weight-level check
  verifier.py     `SyncVerifier`: the run's probe, tolerance, due syncs and calibration
  sync.py         `WeightSync`: the trainer's one object for the sync and its verification

This package imports no engine (mcore_rl/rollout/ builds on it: the receiver, the fingerprints); the engines are
called through their protocol's methods.
"""
