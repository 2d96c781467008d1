"""What `heterorl serve` holds for Tinker's SDK (`TinkerBook`): its models — created, trained, saved and loaded —
over heterorl's own `Service`, with the names of its sessions, models and sampling sessions (`TinkerNames`,
heterorl.service.tinker.names) and its sampling (`TinkerSampling`, heterorl.service.tinker.sampling).

A Tinker model (``SESSION:train:N``) is a heterorl training session. Calls are `Service` calls: run in order per
model, bounded in number, kept ``result_ttl_s`` after they finish, and run once per Tinker request (a retried
``seq_id`` returns the first call's id). Checkpoints are heterorl training states (`CheckpointStore`), which
outlive the service.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from heterorl.errors import HeteroRLError
from heterorl.service.bounds import check_training_size
from heterorl.service.calls import BadRequest, NotFound
from heterorl.service.sessions import Service, _then
from heterorl.service.tinker import losses, protobuf
from heterorl.service.tinker.checkpoints import CheckpointStore
from heterorl.service.tinker.convert import adam_params, lora_spec
from heterorl.service.tinker.names import Model, SamplingSession, SessionFinished, TinkerNames
from heterorl.service.tinker.sampling import TinkerSampling
from heterorl.training.session import read_training_state

MAX_DATUMS = 1024  # per forward_backward request (the SDK splits bigger calls into requests of 1024)


class TinkerBook:
    """Tinker's models over `Service`'s sessions, and the names (`names`) and sampling (`sampling`) it owns (see
    the module)."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.store = CheckpointStore(service.state_dir / "tinker")
        self.names = TinkerNames(service)
        self.sampling = TinkerSampling(service, self.names, self.store, self.resolve_base)
        self._loads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tinker-load")  # model loads

    # -- models -------------------------------------------------------------------------------------------
    def training(self, model_id: str):
        model = self.names.model(model_id)
        return self.service.session(model.session_id)

    def resolve_base(self, base_model: str) -> str:
        """heterorl's name of a base model named as the SDK names it: a name `heterorl serve` loads (``--model
        NAME=PATH``, the shipped policies) or the absolute path of one of their folders. (A name is answered
        without looking at any folder: SmolLM2's is made on its first load, which may take minutes.)"""
        names = [m["name"] for m in self.service.list_base_models()]
        if base_model in names:
            return base_model
        if base_model.startswith("/"):
            wanted = str(Path(base_model).resolve())
            for name in sorted(names, key=lambda n: n == "smollm2"):  # (SmolLM2's folder is made when first asked)
                if self.base_folder(name) == wanted:
                    return name
        raise BadRequest(f"base_model {base_model[:200]!r} is not served here: give one of {', '.join(names)}, or "
                         "the absolute path of its folder (a server adds folders with --model NAME=PATH)")

    def base_folder(self, name: str) -> str | None:
        """The folder a base model loads from (what the SDK loads its tokenizer from); None when it has none."""
        from heterorl.policies import policy_folder

        try:
            folder = Path(self.service.models[name]) if name in self.service.models else policy_folder(name)
            return str(folder.resolve())
        except (HeteroRLError, OSError):
            return None

    def create_model(self, session_id: str, seq: int, base_model: str, lora_config: dict | None,
                     user_metadata: dict | None) -> str:
        """Submit the load of a model (a heterorl session) as a call; its id."""
        self.names.session(session_id)
        name = self.resolve_base(base_model)
        spec = lora_spec(lora_config)
        model_id = f"{session_id}:train:{int(seq)}"

        def load() -> dict:
            seed = (lora_config or {}).get("seed")
            described = self.service.create_session(name, seed if isinstance(seed, int) else None, True, spec)
            self._add_model(Model(model_id, described["session_id"], base_model,
                                  spec["rank"] if spec else None, dict(user_metadata or {})))
            return {"model_id": model_id, "type": "create_model"}

        return self._submit(session_id, "create_model", model_id, lambda: self._loads.submit(load))

    def _add_model(self, model: Model) -> None:
        """Name ``model`` and write its description beside its checkpoints (the run listings read it)."""
        self.names.add_model(model)
        lora = self.service.session(model.session_id).training.lora
        self.store.write_run(model.model_id, {
            "training_run_id": model.model_id, "base_model": model.base_model, "is_lora": model.lora_rank is not None,
            "lora_rank": model.lora_rank, "user_metadata": model.user_metadata, "created": model.created,
            "lora": lora.to_dict() if lora is not None else None})

    def info(self, model_id: str) -> dict:
        model = self.names.model(model_id)
        folder = self.base_folder(self.resolve_base(model.base_model))
        data = {"model_name": model.base_model, "arch": type(self.training(model_id).training.model).__name__}
        if folder is not None:
            data["tokenizer_id"] = folder
        return {"type": "get_info", "model_id": model_id, "model_data": data, "is_lora": model.lora_rank is not None,
                "lora_rank": model.lora_rank, "model_name": model.base_model, "optimizer_config": {"type": "adamw"}}

    def _submit(self, owner: str, kind: str, key: str, start) -> str:
        """A call of ``owner`` (a heterorl or Tinker session) run once per (``kind``, ``key``)."""
        return self.service._submit(owner, f"tinker:{kind}", key, start)

    # -- training calls -----------------------------------------------------------------------------------
    def forward_backward(self, request: protobuf.ForwardBackwardRequest) -> str:
        session = self.training(request.model_id)
        # the native routes' bounds (the model's context and ids, the tokens of one call), before any tensor: on
        # the sequences heterorl will score, model_input + [target_tokens[-1]] (`losses.build`)
        check_training_size("forward_backward", {"datums": [{"tokens": [*d.tokens, _last_target(d)], "prompt_len": 1}
                                                           for d in request.data]}, session.training)
        datums, loss_fn, config = losses.build(request.data, request.loss_fn, request.loss_fn_config)
        ours = request.loss_fn not in losses.TINKER_LOSSES
        method = session.training.forward if request.forward_only else session.training.forward_backward

        def answer(out) -> bytes:
            metrics = losses.metrics_for_tinker(out.loss, out.metrics, ours)
            return protobuf.forward_backward_output([np.asarray(lp, dtype=np.float32) for lp in out.logprobs],
                                                    metrics)

        lengths = [len(d.tokens) + 1 for d in request.data]  # (what check_training_size counted above)
        call = "forward" if request.forward_only else "forward_backward"
        return self._submit(session.session_id, "forward_backward", f"{request.model_id}/{request.seq_id}",
                            lambda: self.service.start_counted(session, call, lengths,
                                                               lambda: _then(method(datums, loss_fn, config), answer)))

    def optim_step(self, model_id: str, seq: int, adam: dict) -> str:
        session = self.training(model_id)
        params = adam_params(adam)

        def answer(out) -> dict:
            metrics = {"optim/step:max": float(out.step), "optim/skipped:max": float(out.skipped)}
            if math.isfinite(out.grad_norm):
                metrics["optim/grad_norm:mean"] = out.grad_norm
            return {"metrics": metrics}

        return self._submit(session.session_id, "optim_step", f"{model_id}/{seq}",
                            lambda: _then(session.training.optim_step(params), answer))

    # -- checkpoints --------------------------------------------------------------------------------------
    def save_state(self, model_id: str, seq: int, name: str, overwrite: bool) -> str:
        """``save_state``: the weights (a LoRA adapter) and the optimizer, as ``tinker://MODEL/weights/NAME``."""
        session = self.training(model_id)
        path = self.store.path(model_id, "weights", name)
        if path.exists() and not overwrite:
            raise BadRequest(f"model {model_id} already has a checkpoint named {name!r}; choose another "
                             "name or pass overwrite")
        path.parent.mkdir(parents=True, exist_ok=True)
        return self._submit(session.session_id, "save_weights", f"{model_id}/{seq}", lambda: _then(
            session.training.save_state(path), lambda _: {"path": f"tinker://{model_id}/weights/{name}",
                                                          "type": "save_weights"}))

    def save_for_sampler(self, model_id: str, seq: int, name: str | None, sampler_seq: int | None) -> str:
        """``save_weights_for_sampler(name)``: the weights as ``tinker://MODEL/sampler_weights/NAME`` (and a sampling
        client of them kept); without a name, a sampling session (``save_weights_and_get_sampling_client``)."""
        session = self.training(model_id)
        model = self.names.model(model_id)
        owner = model_id.split(":")[0]
        if name is None:
            if not isinstance(sampler_seq, int):
                raise BadRequest("give a path (a name) or a sampling_session_seq_id")
            sampler_id = f"{owner}:sample:{sampler_seq}"

            def made(sampler) -> dict:
                kept = self.service._keep_sampler(session, sampler)
                self.names.add_sampler(sampler_id, SamplingSession(kept["model"], model.base_model, None))
                return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

            return self._submit(session.session_id, "save_weights_for_sampler", f"{model_id}/{seq}",
                                lambda: _then(session.training.snapshot(), made))
        path = self.store.path(model_id, "sampler_weights", name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tinker_path = f"tinker://{model_id}/sampler_weights/{name}"
        return self._submit(session.session_id, "save_weights_for_sampler", f"{model_id}/{seq}", lambda: _then(
            session.training.save_state(path), lambda _: {"path": tinker_path, "type": "save_weights_for_sampler"}))

    def load_state(self, model_id: str, seq: int, tinker_path: str, optimizer: bool) -> str:
        """``load_state`` / ``load_state_with_optimizer`` on an existing model."""
        session = self.training(model_id)
        _, _, _, path = self.store.checkpoint(tinker_path)
        return self._submit(session.session_id, "load_weights", f"{model_id}/{seq}",
                            lambda: self._load_into(session.training, path, optimizer, model_id, tinker_path))

    def _load_into(self, training, path: Path, optimizer: bool, model_id: str, tinker_path: str) -> Future:
        state = read_training_state(path)
        if not optimizer:
            state["optimizer"] = None

        def done(_) -> dict:
            if not optimizer:
                training.optimizer = None  # (a fresh AdamW at the next step; runs before the next call)
            return {"path": tinker_path, "model_id": model_id, "type": "load_weights"}

        return _then(training.load_state(state), done)

    def create_from_state(self, session_id: str, seq: int, tinker_path: str, optimizer: bool,
                          user_metadata: dict | None) -> str:
        """``create_training_client_from_state[_with_optimizer]``: a new model with the checkpoint's base and
        adapter, loaded from it."""
        self.names.session(session_id)
        source, _, _, path = self.store.checkpoint(tinker_path)
        meta = self.store.run_meta(source)
        name = self.resolve_base(meta["base_model"])
        model_id = f"{session_id}:train:{int(seq)}"

        def load() -> dict:
            lora = meta.get("lora")
            described = self.service.create_session(name, None, True, lora)
            self._add_model(Model(model_id, described["session_id"], meta["base_model"], meta.get("lora_rank"),
                                  dict(user_metadata or meta.get("user_metadata") or {})))
            training = self.service.session(described["session_id"]).training
            return self._load_into(training, path, optimizer, model_id, tinker_path).result()

        return self._submit(session_id, "load_weights", model_id, lambda: self._loads.submit(load))


def _last_target(datum: protobuf.Datum) -> int:
    """The token a Tinker datum's last position predicts (0 when it gives none: `losses.build` then says so)."""
    targets = datum.inputs.get("target_tokens")
    if targets is None or not len(targets) or np.asarray(targets).dtype.kind not in "iu":
        return 0
    return int(targets[-1])


__all__ = ["MAX_DATUMS", "Model", "NotFound", "SamplingSession", "SessionFinished", "TinkerBook"]
