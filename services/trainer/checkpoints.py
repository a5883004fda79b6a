"""Trainer checkpoints without pickle (safetensors for tensors, JSON for the rest), whole or a shard
per FSDP rank; resuming from the newest, and a rank taking the lead from the newest agreed step.

A folder ``step-<n>/`` renamed into place, then ``LATEST`` replaced atomically; the newest `KEEP` stay,
and the one holding the newest version's bytes (`fulmen.versions.rebuild` reads it when Redis lost
them). Each records its experiment, and only that experiment resumes it. The layout, the barriers
and why a resume takes up each piece: docs/design/trainer.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fulmen.errors import InvalidInput
from fulmen.keys import TRAINERS_GROUP
from fulmen.records import TrainStep
from fulmen.records.ranks import AgreedStep
from fulmen.telemetry.steps import append_step, latest_step
from fulmen.versions.model_version import BASE_VERSION, ModelVersion, is_published
from fulmen.versions.rebuild import checkpoints_of
from fulmen_trainer.distributed.leadership import claim_pending
from fulmen_trainer.publishing import republish_if_lost
from fulmen_trainer.values import save_value_head

log = logging.getLogger(__name__)

KEEP = 2  # checkpoints kept on disk
SHARD = "shard-{rank}.safetensors"
RECOVER_READ_COUNT = 1000  # pending entries per read when recovering after a restart


@dataclass
class Checkpoint:
    step: int
    model_version: str
    consumed_entry_ids: list[str]  # acknowledged on the stream only after this checkpoint is written
    extra: dict[str, Any] = field(default_factory=dict)
    experiment: str | None = None  # the experiment that wrote it (None: before checkpoints recorded one)


class CheckpointOfAnotherExperiment(InvalidInput):
    """The newest checkpoint in the trainer's folder was written by another experiment."""


def _flatten(prefix: str, value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Tensors go to ``tensors`` under a dotted name; the rest stays as JSON, with placeholders."""
    if isinstance(value, torch.Tensor):
        tensors[prefix] = value.detach().contiguous().clone()
        return {"__tensor__": prefix}
    if isinstance(value, dict):
        return {str(k): _flatten(f"{prefix}.{k}", v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_flatten(f"{prefix}.{i}", v, tensors) for i, v in enumerate(value)]
    return value


def _unflatten(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return tensors[value["__tensor__"]]
        return {k: _unflatten(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_unflatten(v, tensors) for v in value]
    return value


def _int_keys(state: dict[str, Any]) -> dict[Any, Any]:
    """JSON turned the optimizer's integer parameter ids into strings; turn them back."""
    return {int(k) if k.isdigit() else k: v for k, v in state.items()}


def _checkpoint_of(meta: dict[str, Any]) -> Checkpoint:
    return Checkpoint(meta["step"], meta["model_version"], meta["consumed_entry_ids"], meta["extra"],
                      meta.get("experiment"))


def check_experiment(path: Path, experiment: str) -> None:
    """Refuse the checkpoint at ``path`` unless ``experiment`` wrote it: resuming another experiment's
    weights and step would mix two runs. One written before checkpoints recorded their experiment is
    taken up, with a warning."""
    written_by = json.loads((path / "meta.json").read_text()).get("experiment")
    if written_by is None:
        log.warning("%s records no experiment (written by an older Fulmen): resuming it as experiment %r",
                    path, experiment)
    elif written_by != experiment:
        raise CheckpointOfAnotherExperiment(
            f"{path} is a checkpoint of experiment {written_by!r}, and this trainer runs experiment "
            f"{experiment!r}: point --checkpoint-dir (FULMEN_CHECKPOINT_DIR) at a folder of this "
            f"experiment's own (unset, it is <data_dir>/checkpoints/{experiment}), or set "
            f"FULMEN_EXPERIMENT={written_by} to resume that experiment"
        )


def _fresh_tmp(directory: Path, tmp: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()


def _put_in_place(directory: Path, tmp: Path, final: Path, model_version: str) -> None:
    """The written folder renamed to ``final``, then ``LATEST`` pointed at it; the oldest beyond KEEP go,
    but for the one of the step that published ``model_version`` (the newest checkpoint's): the bytes
    of that version, which `fulmen.versions.rebuild` writes again if Redis loses them."""
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = directory / ".LATEST.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, directory / "LATEST")
    published = checkpoints_of(directory, model_version)[:1] if model_version != BASE_VERSION.name else []
    for old in sorted(directory.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[:-KEEP]:
        if old not in published:
            shutil.rmtree(old, ignore_errors=True)


def save(
    directory: Path,
    checkpoint: Checkpoint,
    model: Any,
    optimizer: torch.optim.Optimizer,
    codec_state: dict[str, Any] | None = None,
    value_head: torch.nn.Module | None = None,
) -> Path:
    """The step's model (``model/``, a Hugging Face folder), its value head beside it if it has one
    (`fulmen_trainer.values`), the optimizer and the rest; in place once whole."""
    final = directory / f"step-{checkpoint.step}"
    tmp = directory / f".step-{checkpoint.step}.tmp"
    _fresh_tmp(directory, tmp)
    model.save_pretrained(tmp / "model", safe_serialization=True)
    if value_head is not None:
        save_value_head(value_head, tmp)
    tensors: dict[str, torch.Tensor] = {}
    optim = optimizer.state_dict()
    meta = {
        "step": checkpoint.step,
        "model_version": checkpoint.model_version,
        "experiment": checkpoint.experiment,
        "consumed_entry_ids": checkpoint.consumed_entry_ids,
        "extra": checkpoint.extra,
        "optimizer": {"state": _flatten("optim", optim["state"], tensors), "param_groups": optim["param_groups"]},
        "codec": _flatten("codec", codec_state or {}, tensors),
    }
    save_file(tensors, str(tmp / "state.safetensors"))
    (tmp / "meta.json").write_text(json.dumps(meta))
    _put_in_place(directory, tmp, final, checkpoint.model_version)
    return final


def latest(directory: Path) -> Path | None:
    marker = directory / "LATEST"
    if not marker.exists():
        return None
    path = directory / marker.read_text().strip()
    return path if (path / "meta.json").exists() else None


def load(path: Path, optimizer: torch.optim.Optimizer) -> tuple[Checkpoint, dict[str, Any]]:
    """Restore the optimizer in place; return the checkpoint and the codec state. (The model is loaded
    from ``path / "model"`` by the caller, like any Hugging Face folder.)"""
    meta = json.loads((path / "meta.json").read_text())
    tensors = load_file(str(path / "state.safetensors"))
    state = _int_keys(_unflatten(meta["optimizer"]["state"], tensors))
    optimizer.load_state_dict({"state": state, "param_groups": meta["optimizer"]["param_groups"]})
    return _checkpoint_of(meta), _unflatten(meta["codec"], tensors)


# --- sharded: a shard per FSDP rank, nobody gathers the model ------------------------------------------


def is_sharded(path: Path) -> bool:
    return (path / SHARD.format(rank=0)).exists()


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def save_sharded(directory: Path, checkpoint: Checkpoint, model: Any, optimizer: torch.optim.Optimizer,
                 rank: int, world: int, group: Any) -> Path:
    final = directory / f"step-{checkpoint.step}"
    tmp = directory / f".step-{checkpoint.step}.tmp"
    if rank == 0:
        _fresh_tmp(directory, tmp)
    dist.barrier(group=group)
    tensors = {f"model.{n}": _local(p.detach()).contiguous().clone()
               for n, p in model.named_parameters() if p.requires_grad}
    optim = optimizer.state_dict()
    state = {i: {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for i, s in optim["state"].items()}
    layout = {"state": _flatten("optim", state, tensors), "param_groups": optim["param_groups"]}
    save_file(tensors, str(tmp / SHARD.format(rank=rank)), metadata={"optimizer": json.dumps(layout)})
    dist.barrier(group=group)
    if rank == 0:
        meta = {"step": checkpoint.step, "model_version": checkpoint.model_version, "world": world,
                "experiment": checkpoint.experiment, "consumed_entry_ids": checkpoint.consumed_entry_ids,
                "extra": checkpoint.extra}
        (tmp / "meta.json").write_text(json.dumps(meta))
        _put_in_place(directory, tmp, final, checkpoint.model_version)
    dist.barrier(group=group)
    return final


def load_sharded(path: Path, model: Any, optimizer: torch.optim.Optimizer, rank: int, world: int) -> Checkpoint:
    """This rank's shard into the (already sharded) model and its optimizer; the checkpoint's meta."""
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("world") != world:
        raise RuntimeError(f"{path} was written by {meta.get('world')} FSDP ranks and this run has {world}: "
                           "resume with the same --nproc-per-node")
    shard = path / SHARD.format(rank=rank)
    tensors = load_file(str(shard))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                _local(p).copy_(tensors[f"model.{name}"])
    with safe_open(str(shard), framework="pt") as f:
        layout = json.loads(f.metadata()["optimizer"])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = _int_keys(_unflatten(layout["state"], tensors))
    for index, entry in state.items():
        p = params[index]
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and hasattr(p, "device_mesh") and value.dim() > 0:
                from torch.distributed.tensor import DTensor

                entry[key] = DTensor.from_local(value.to(_local(p).device), p.device_mesh, p.placements,
                                                shape=p.shape, stride=p.stride())
    optimizer.load_state_dict({"state": state, "param_groups": layout["param_groups"]})
    return _checkpoint_of(meta)


# --- resume: a trainer coming back ---------------------------------------------------------------------


async def resume_from(trainer: Any, path: Path, sharded: bool) -> set[str]:
    """Take up the checkpoint at ``path`` (model weights are loaded already): its optimizer, step and
    version, the version it took but had not published yet, the metrics it had not logged; return the
    sample entries it consumed, which `recover_pending` acknowledges. Called by `Trainer.setup`; a
    checkpoint of another experiment raises `CheckpointOfAnotherExperiment` before anything is taken up."""
    check_experiment(path, trainer.s.experiment)
    if sharded:
        assert hasattr(trainer.ranks, "load_checkpoint")  # `Trainer.setup` checked: torch.distributed ranks
        checkpoint, codec_state = await asyncio.to_thread(trainer.ranks.load_checkpoint, path, trainer), {}
    else:
        checkpoint, codec_state = load(path, trainer.optimizer)
    if trainer.ranks is not None and codec_state:
        trainer.ranks.codec.load_state_dict(codec_state)  # error feedback carries over the restart
    trainer.step, trainer.version = checkpoint.step, ModelVersion.parse(checkpoint.model_version)
    trainer.checkpointed_step = trainer.step
    already_done = set(checkpoint.consumed_entry_ids)
    log.info("resumed from %s: step %d, model version %s", path, trainer.step, trainer.version)
    if not trainer.leads:  # ranks over Redis: the rank that takes the lead does this (`resume_lead`)
        return already_done
    if trainer.version.number > 0 and not await is_published(trainer.store, trainer.version.name):
        # killed between the checkpoint and the publish: these weights are that version
        log.info("model version %s was checkpointed but not published: publishing it now", trainer.version)
        await trainer.publish(resumed=True)
    else:
        await republish_if_lost(trainer, now=True)  # Redis restarted since it was written
    if trainer.rank == 0:
        # a trainer that died after its checkpoint but before the metrics write (SIGKILL, or
        # Redis gone at the acknowledgement) logs those steps now, or the file misses them
        trainer.mirror.append(checkpoint.extra.get("metrics", []))
        # likewise the steps stream, which the algorithm paces on: a step it never sees would
        # leave it waiting for the trainer, and the trainer for its rollouts
        logged = await latest_step(trainer.store.redis, trainer.store.keys)
        for line in checkpoint.extra.get("metrics", []):
            if line["step"] > logged:
                trainer.metrics.record(line["step"], line)
    return already_done


async def recover_pending(trainer: Any, already_done: set[str]) -> None:
    """Entries read before a restart: those the last checkpoint consumed are acknowledged now; the
    rest go back into the groups."""
    acked = requeued = 0
    after = "0"
    while True:
        entries = await trainer.store.samples.read_samples(TRAINERS_GROUP, trainer.consumer, count=RECOVER_READ_COUNT,
                                                           pending=True, after=after)
        if not entries:
            break
        after = entries[-1][0]
        done = [e for e, _ in entries if e in already_done]
        await trainer.store.samples.ack_samples(TRAINERS_GROUP, done)
        acked += len(done)
        rest = [(entry_id, item) for entry_id, item in entries if entry_id not in already_done]
        await trainer.take(rest)
        requeued += len(rest)
    if acked or requeued:
        log.info("after restart: %d entries were already trained on, %d back in their groups", acked, requeued)


# --- taking the lead: ranks over Redis -----------------------------------------------------------------


async def resume_lead(trainer: Any, group: Any) -> None:
    """A rank that took the lead (at start, or when the leader's lease ran out) goes on from its own
    weights and the steps the ranks agreed: every sample entry pending in the trainers' group becomes
    its own; those an agreed step of its lineage consumed are acknowledged after a checkpoint, the rest
    go back into groups (a step never agreed is trained again from them). The newest agreed step's
    version and steps-stream record are written if its leader died before writing them."""
    # an agreed step's entries are acknowledged at its leader's next checkpoint: look back two
    # intervals (one leader killed between its checkpoint and the acknowledgement)
    records = await group.leadership.agreed_back_to(trainer.step - 2 * trainer.s.checkpoint_every - 1)
    await catch_up(trainer, records)
    lineage = _lineage(records, trainer.step)
    consumed = set(trainer.resumed_consumed).union(*(r.entry_ids for r in lineage))
    trainer.resumed_consumed = set()
    entries = await claim_pending(trainer.store, trainer.consumer)
    done = [entry_id for entry_id, _ in entries if entry_id in consumed]
    await trainer.take([(entry_id, item) for entry_id, item in entries if entry_id not in consumed])
    if records and records[0].step > trainer.step:
        log.warning("rank %d leads from step %d, behind the agreed step %d: the steps after %d are trained "
                    "again (from their samples, still pending)", trainer.rank, trainer.step, records[0].step,
                    trainer.step)
    if lineage and lineage[0].step == trainer.step:
        trainer.version = ModelVersion.parse(lineage[0].model_version)
        await _finish_agreed(trainer, lineage[0])
    trainer.metrics.log_steps_to(trainer.store)
    trainer.consumed_since_checkpoint += done
    if done:
        await trainer.checkpoint()  # then acknowledges them
    log.info("rank %d leads at step %d (model version %s): of %d pending entries, %d were trained already",
             trainer.rank, trainer.step, trainer.version, len(entries), len(done))


async def catch_up(trainer: Any, records: list[AgreedStep]) -> AgreedStep | None:
    """A rank behind the newest agreed step (left out of the last step, or slow to follow) that takes
    the lead loads the newest agreed version that is published first, rather than train again from
    older weights: the steps in between were acknowledged at their leader's checkpoints, and their
    samples would not come back. ``records``: newest first. Returns the step it caught up with."""
    for record in records:
        if record.step <= trainer.step:
            return None
        if record.publishes and await is_published(trainer.store, record.model_version):
            log.warning("rank %d takes the lead at step %d, behind the agreed step %d: loading model version %s "
                        "(step %d) first", trainer.rank, trainer.step, records[0].step, record.model_version,
                        record.step)
            await trainer.load_version(ModelVersion.parse(record.model_version), record.step)
            return record
    return None


def _lineage(records: list[AgreedStep], step: int) -> list[AgreedStep]:
    """The agreed steps (newest first) whose weights lead to ours at ``step``: step, step - 1, ...;
    a step agreed again after a leader went on from an older checkpoint hides the earlier one."""
    out: list[AgreedStep] = []
    for record in records:
        if record.step == step - len(out):
            out.append(record)
    return out


async def _finish_agreed(trainer: Any, record: AgreedStep) -> None:
    """What a leader writes after agreeing a step, written again: its version and its steps record."""
    if record.publishes and not await is_published(trainer.store, record.model_version):
        log.info("model version %s was agreed but not published: publishing it now", record.model_version)
        await trainer.publish(resumed=True)
    if await latest_step(trainer.store.redis, trainer.store.keys) < record.step:
        await append_step(trainer.store.redis, trainer.store.keys, TrainStep.from_wire(record.summary))
