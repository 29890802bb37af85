"""The one settings object of the service and the offline scorer.

Every field is a command-line option (``max_batch_tokens`` -> ``--max-batch-tokens``) and an
environment variable (``PACKSCORE_MAX_BATCH_TOKENS``); an option given on the command line wins
over the environment, which wins over the default. ``main()`` builds it once and passes it down.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from model_runtime.kernels.overrides import FAMILIES, check_kernel_overrides, parse_kernel_overrides

LogLevel = Literal["critical", "error", "warning", "info", "debug"]
DEFAULT_QUEUED_TOKENS = 1 << 20  # the hard cap on admitted tokens of a one-GPU server
# Bytes a request may take per token when it must be admissible: a JSON id of up to 6 digits and
# a JSON rollout log-prob (a float64's shortest repr, up to 24 characters), each with json.dumps'
# ", " separator; plus per-sequence and fixed room.
_BODY_BYTES_PER_TOKEN = 34
_BODY_BYTES_PER_SEQUENCE = 256
_BODY_BYTES_FIXED = 1 << 20


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PACKSCORE_", extra="forbid", validate_default=True)

    # What to serve.
    model: str = Field(
        "tiny",
        description="checkpoint directory (config.json + *.safetensors), preset name, or Hugging Face hub id "
        "(ORG/NAME: from the local cache, HF_HOME / HF_HUB_CACHE, downloaded there where the hub is reachable); "
        "several models: NAME=PATH_OR_PRESET, the option repeated (in PACKSCORE_MODEL: comma-separated, or a "
        "JSON object of name -> path)",
    )
    revision: str | None = Field(None, description="branch, tag or commit of a hub id --model (default: main)")
    served_model_name: str | None = Field(None, description="name clients use in 'model' (default: the model's)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="compute dtype; auto is bfloat16 on CUDA, float32 on CPU"
    )
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N; auto picks cuda when available")
    allow_slow_kernels: bool = Field(
        False, description="allow per-sequence reference kernels on a GPU instead of refusing to start"
    )
    # Parsed once, here: FAMILY=BACKEND text (the option, the environment) becomes family -> backend.
    kernels: Annotated[dict[str, str], NoDecode] = Field(
        None,
        description="pin kernel backends, FAMILY=BACKEND[,...], e.g. attention=varlen (families: "
        f"{', '.join(FAMILIES)}); default: the fastest installed that keeps Hugging Face's arithmetic "
        "(elementwise=inductor: a float32 rounding off, no faster on an H200; gate_projection=tiles: every member of "
        "a group shares its prompt, bit for bit, but about 1e-2 from Hugging Face one at a time, as its padded "
        "batches are); /v1/models shows what runs",
    )
    triton_cache_dir: Path | None = Field(
        None, description="directory for compiled Triton and Inductor kernels (sets TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR=DIR/inductor)"
    )
    expert_gemm: Path | None = Field(
        None, description="the MoE experts' CUTLASS library (expert_tiles_silu and expert_tiles, Hopper; default: where "
        "`python -m model_runtime.kernels.expert_gemm` builds it, in $PACKSCORE_CACHE_DIR/kernels)"
    )

    # Parallelism (world_size > 1, sp > 1 or fsdp start the multi-process worker pool).
    world_size: int = Field(1, ge=1, description="GPUs (worker processes) the model runs on")
    sp: int = Field(1, ge=1, description="sequence-parallel degree inside a data-parallel group")
    fsdp: bool = Field(False, description="shard parameters over every rank of the world, all groups together (FSDP2)")

    # HTTP.
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on")
    api_key: SecretStr | None = Field(None, description="require 'Authorization: Bearer <key>' on every route but /healthz, /health, /readyz")
    api_key_file: Path | None = Field(None, description="file holding the API key (a mounted secret)")
    weights_root: Path | None = Field(
        None, description="directory under which POST /v1/weights may load new checkpoints (unset: no weight updates)"
    )
    weights_record: Path | None = Field(
        None, description="file where each served model's last weight update is recorded (rewritten atomically "
        "after every update; its directory must exist and take a new file, FILE be this user's in a sticky "
        "directory and FILE.lock be writable); at start a model whose entry names the "
        "same --model serves the recorded checkpoint (from --weights-root) under its version instead, and one "
        "whose recorded checkpoint cannot be served waits, not ready, for its next weight update; a record that "
        "cannot be read refuses the start; several servers may share FILE (each write merges under a lock on "
        "FILE.lock, keeping the update requested last), so a new one starts at their last update "
        "(unset: a restart serves --model)"
    )
    admin_key: SecretStr | None = Field(
        None, description="key POST /v1/weights requires instead of the API key (which it then refuses)"
    )
    admin_key_file: Path | None = Field(None, description="file holding the admin key (a mounted secret)")
    log_level: LogLevel = Field("info", description="logging level")

    # Scheduling and admission.
    max_batch_tokens: int = Field(16384, ge=1, description="token budget of one packed forward (per GPU)")
    max_wait_ms: float = Field(5.0, ge=0, description="how long a queued sequence may wait for its batch to fill")
    queue_seconds: float = Field(
        4.0,
        gt=0,
        description="admission bound in time: the queue holds this many seconds of measured scoring work per GPU "
        "(never less than 3 full rows per GPU, the bound before any row was measured); a request beyond it waits",
    )
    max_admission_wait_s: float = Field(
        30.0,
        ge=0,
        description="how long a request over the admission bound waits server-side for room (at most its "
        "deadline_ms) before 429 with Retry-After; 0 answers 429 at once",
    )
    max_queued_tokens: int | None = Field(
        None,
        ge=1,
        description="hard cap on tokens admitted and not yet scored, whatever --queue-seconds allows, and the "
        "largest request (413 beyond it); requests waiting for room hold at most as many again (429 beyond). "
        "Default: max(1048576, 4 x world-size x max-batch-tokens)",
    )
    max_request_bytes: int | None = Field(
        None,
        ge=1,
        description="largest request body in bytes; beyond it 413. Default: what the largest admissible request "
        "needs, 34 bytes per token of --max-queued-tokens (an id and a rollout log-prob in JSON) + 256 per sequence "
        "of --max-sequences-per-request + 1 MiB",
    )
    request_read_timeout_s: float = Field(
        30.0, gt=0, description="a request's headers and body must arrive within this many seconds, else the "
        "connection is closed (408 when possible)"
    )
    send_timeout_s: float = Field(
        60.0, gt=0, description="an answer the client stops reading (none of it drains for this many seconds) is "
        "dropped and its connection closed; a slow but steady reader is never cut off"
    )
    keep_alive_timeout_s: float = Field(
        75.0, gt=0, description="how long an idle kept-alive connection stays open; above the idle timeout of a "
        "proxy in front (ingress-nginx and AWS ALB: 60 s), so that the proxy, not the server, closes it"
    )
    max_connections: int | None = Field(
        None,
        ge=1,
        description="most open client connections; a new one beyond it closes the connection whose request has "
        "been arriving the longest, or an idle one. Default: the descriptor limit less those in use and 64",
    )
    max_model_len: int | None = Field(None, ge=1, description="longest sequence accepted; default: the model's")
    max_sequences_per_request: int = Field(4096, ge=1, description="most sequences in one request; beyond it 413")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, how long admitted requests may take to finish")
    # Default on where sharing changes no number (a GPU, whole sequences on each rank): there a prompt
    # is shared only among members whose lengths compute it alike, bit for bit and faster on
    # the 9B's RL mix; off on the CPU (float32 within 1e-5, not bit for bit) and under --sp > 1
    # (every member shares, about 1e-2 in bf16). docs/prefix-sharing.md.
    prefix_sharing: bool | None = Field(
        None, description="run leading tokens that sequences of one row share (a GRPO group's prompt) once. "
        "Default: on a GPU with --sp 1, where it shares only among members whose lengths compute the prompt "
        "alike (measured at start-up, kept in $PACKSCORE_CACHE_DIR) and changes no number; off on the CPU and "
        "under --sp > 1. --prefix-sharing forces it there too (under --sp > 1 a result may move by about 1e-2 "
        "in bf16; on the CPU a shared prompt's members by a few 1e-6, the head's rounding of the positions "
        "scored beside them); --no-prefix-sharing: every sequence runs whole"
    )
    prefix_min_tokens: int = Field(64, ge=1, description="shortest shared prefix worth running once (tokens)")

    # Offline scoring (packscore score): the options every line of the input is scored with.
    temperature: float = Field(1.0, gt=0, allow_inf_nan=False, description="logits are divided by it before the softmax")
    top_k: int = Field(0, ge=0, le=20, description="also return the k most likely tokens per scored position")
    return_entropy: bool = Field(True, description="return the entropy of every scored position")

    @model_validator(mode="after")
    def _one_key_source(self) -> "Settings":
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("give --api-key or --api-key-file, not both")
        if self.admin_key is not None and self.admin_key_file is not None:
            raise ValueError("give --admin-key or --admin-key-file, not both")
        if self.world_size % self.sp:  # refused here, before a port is bound or a worker starts
            raise ValueError(f"--world-size {self.world_size} is not divisible by --sp {self.sp}: "
                             "a sequence-parallel group needs sp of the world's GPUs")
        specs = self.model_specs()  # raises on a malformed list of models
        if len(specs) > 1 and self.served_model_name is not None:
            raise ValueError("--served-model-name names the only model; with several, name each as --model NAME=PATH")
        if self.served_model_name is not None and None not in specs:  # else one of the two names is silently dropped
            (name,) = specs
            raise ValueError(f"--served-model-name {self.served_model_name!r} and --model {name}=... both name the "
                             "model: give one of them")
        return self

    def model_specs(self) -> dict[str | None, str]:
        """``--model`` as served name -> path or preset; the name is None for a plain ``--model X``
        (served as ``--served-model-name`` or the model's own name).

        Accepted forms: ``X``, ``NAME=X``, ``A=X,B=Y``, a JSON list of those, or a JSON object
        ``{"A": "X", "B": "Y"}`` (the CLI passes a repeated option as a JSON list).
        """
        return parse_model_specs(self.model)

    def for_model(self, name: str | None, spec: str) -> "Settings":
        """These settings for one served model: its path and its served name."""
        return self.model_copy(update={"model": spec, "served_model_name": name or self.served_model_name})

    @field_validator("device")
    @classmethod
    def _device_known(cls, value: str) -> str:
        # the loader and the kernels know these two device types: another fails at once, not after the port is bound
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ValueError(f"{value!r} is not a device packscore runs on; give auto, cpu, cuda or cuda:N")
        return value

    @field_validator("host")
    @classmethod
    def _host_given(cls, value: str) -> str:
        # An empty address binds every interface: a variable gone wrong must not open the server to the network.
        if not value.strip():
            raise ValueError("is empty, which would listen on every interface; give 0.0.0.0 for that, "
                             "or unset it for 127.0.0.1")
        return value

    @field_validator("model", "revision", "served_model_name", "triton_cache_dir", "expert_gemm", "api_key_file",
                     "weights_root", "weights_record", "admin_key_file", mode="before")
    @classmethod
    def _given(cls, value, info: ValidationInfo):
        # Path("") is ".": an empty value (a variable gone wrong) must not become the working directory; an
        # empty revision is none the hub has, and an empty name would be a name to some checks and unset to others.
        if isinstance(value, str) and not value.strip():
            wanted = {"model": "a preset, a checkpoint directory or a hub id", "revision": "a branch, tag or commit",
                      "served_model_name": "a name"}.get(info.field_name, "a path")
            raise ValueError(f"is empty; give {wanted}, or unset it")
        return value

    @field_validator("kernels", mode="before")
    @classmethod
    def _parse_kernels(cls, value) -> dict[str, str]:
        """``--kernels`` text as the family -> backend mapping the loader takes; a mapping (settings
        built in Python) is checked by the same rules."""
        if value is None or isinstance(value, str):
            return parse_kernel_overrides(value or "")
        return check_kernel_overrides(value)

    def resolved_admin_key(self) -> str | None:
        """The key POST /v1/weights requires, read from ``admin_key_file`` when given; None: the API key rules."""
        return _read_key(self.admin_key, self.admin_key_file, "admin key", "admin-key",
                         "unset it to let the API key rule /v1/weights")

    def resolved_api_key(self) -> str | None:
        """The configured key, read from ``api_key_file`` when given; None means no authentication."""
        return _read_key(self.api_key, self.api_key_file, "API key", "api-key", "unset it to serve without one")

    @property
    def queued_tokens(self) -> int:
        """The admission bound in effect: ``--max-queued-tokens``, or one sized to the pool."""
        if self.max_queued_tokens is not None:
            return self.max_queued_tokens
        return max(DEFAULT_QUEUED_TOKENS, 4 * self.world_size * self.max_batch_tokens)

    @property
    def request_bytes(self) -> int:
        """The body limit in effect: ``--max-request-bytes``, or what the largest admissible request needs."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return (_BODY_BYTES_PER_TOKEN * self.queued_tokens + _BODY_BYTES_PER_SEQUENCE * self.max_sequences_per_request
                + _BODY_BYTES_FIXED)

    @property
    def prefix_min_tokens_in_use(self) -> int:
        """The scorers' ``prefix_min_tokens``: 0 when prefix sharing is off (by default off but on
        a GPU with whole sequences on each rank, where it is exact)."""
        if self.prefix_sharing is None:
            return self.prefix_min_tokens if self.sp == 1 and self.device_type == "cuda" else 0
        return self.prefix_min_tokens if self.prefix_sharing else 0

    @property
    def device_type(self) -> str:
        """``--device``'s type, ``auto`` resolved by the model loader's own rule."""
        import torch

        from model_runtime.scoring.loading import default_device

        return (default_device() if self.device == "auto" else torch.device(self.device)).type

    @property
    def uses_worker_pool(self) -> bool:
        return self.world_size > 1 or self.sp > 1 or self.fsdp


def _read_key(value: SecretStr | None, file: Path | None, what: str, option: str, unset: str) -> str | None:
    # An empty secret (a mount or variable gone wrong) must not silently turn authentication off.
    env = "PACKSCORE_" + option.upper().replace("-", "_")
    if file is not None:
        try:
            key = file.read_text().strip()
        except UnicodeDecodeError:
            raise ValueError(f"the {what} file (--{option}-file / {env}_FILE) {file} is not UTF-8 text") from None
        except OSError as exc:
            raise ValueError(f"the {what} file (--{option}-file / {env}_FILE) {file} cannot be read: "
                             f"{exc.strerror or exc}") from None
        if not key:
            raise ValueError(f"the {what} file (--{option}-file / {env}_FILE) {file} is empty")
        return _header_safe(key, f"the {what} file (--{option}-file / {env}_FILE) {file}")
    if value is not None:
        key = value.get_secret_value().strip()
        if not key:
            raise ValueError(f"the {what} (--{option} / {env}) is empty; {unset}")
        return _header_safe(key, f"the {what} (--{option} / {env})")
    return None


def _header_safe(key: str, where: str) -> str:
    # A line break or other control character inside cannot travel in a header: every request would get 401.
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise ValueError(f"{where} holds a control character inside the key (a line break?), which no HTTP header "
                         "can carry (the key is not shown)")
    # HTTP clients (httpx, the bundled client, requests) send headers as ASCII or Latin-1, never this key's UTF-8.
    if not key.isascii():
        raise ValueError(f"{where} holds a character beyond ASCII, which HTTP clients do not send as this server "
                         "reads it (the key is not shown)")
    return key


def parse_model_specs(text: str) -> dict[str | None, str]:
    """``--model``'s value as served name -> path or preset (see ``Settings.model_specs``)."""
    text = text.strip()
    if Path(text).is_dir():  # a directory whose name holds "," or "=" is still one checkpoint
        return {None: text}
    name, sep, spec = text.partition("=")
    if sep and name.strip() and "," in spec and Path(spec.strip()).is_dir():  # so is one named NAME=DIR
        return {name.strip(): spec.strip()}
    if text.startswith("{"):
        try:
            mapping = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--model: not a JSON object of name -> path: {exc}") from None
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
            raise ValueError("--model: a JSON object must map names to path strings")
        items = [f"{k}={v}" for k, v in mapping.items()]
    elif text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--model: not a JSON list: {exc}") from None
        if not all(isinstance(i, str) for i in items):
            raise ValueError("--model: a JSON list must hold NAME=PATH strings")
    else:
        items = text.split(",")
    specs: dict[str | None, str] = {}
    for item in (i.strip() for i in items):
        name, sep, spec = item.partition("=")
        name, spec = (name.strip(), spec.strip()) if sep else (None, item)
        if not spec or name == "":
            raise ValueError(f"--model {item!r}: expected PATH_OR_PRESET or NAME=PATH_OR_PRESET")
        if name in specs:
            raise ValueError(f"--model: the name {name!r} is given twice" if name else "--model: give each model a NAME=")
        specs[name] = spec
    if len(specs) > 1 and None in specs:
        raise ValueError("--model: with several models, name each one as NAME=PATH_OR_PRESET")
    return specs
