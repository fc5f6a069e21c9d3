"""What a job submission must pass before it is queued: a job id, and a config that parses, validates and names only
paths and endpoints this trainer may use."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import errno
import json
import re
import uuid
from pathlib import Path
from typing import Any, Sequence

from prorag.config import to_dict
from prorag.errors import FailedPrecondition, InvalidArgument
from prorag.jsontext import check_strings
from prorag.rpc import jsonbody
from prorag.validation import check_allowed_endpoints, data_roots
from services.trainer.memory_check import check_fits
from services.trainer.stages import Stage, check_job_config, validate_config

MAX_CONFIG_BYTES = 1 << 20
JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


@contextlib.contextmanager
def paths_of_the_config():
    """A path a submitted config names that cannot even be looked at (a name too long for the file system, a
    directory the trainer may not read) is the caller's to fix, not a server error."""
    try:
        yield
    except OSError as e:
        name = str(e.filename or "")
        shown = name if len(name) <= 80 else f"{name[:80]}... ({len(name):,} characters)"
        if e.errno == errno.ENAMETOOLONG:
            raise InvalidArgument(f"config_json names a path that is too long: {shown}") from None
        raise FailedPrecondition(f"config_json names {shown}, which the trainer cannot read: "
                                 f"{e.strerror or e}") from None


class Admission:
    """The checks of one trainer: its jobs root (inside the data root a config's paths must be in), the endpoints
    a config may point at, and the deployment's service addresses for what a config leaves unset."""

    def __init__(self, jobs_root: Path, allowed_endpoints: Sequence[str], service_addresses: dict[str, str], *,
                 memory_check: bool = True):
        self.jobs_root = jobs_root
        self.memory_check = memory_check
        self.allowed_endpoints = check_allowed_endpoints(allowed_endpoints)
        self.service_addresses = dict(service_addresses)

    def config(self, stage: Stage, config: str | dict | None) -> tuple[Any, dict, str]:
        """(the validated config, it as a dict with every default, its canonical JSON); InvalidArgument naming the
        field at fault."""
        if isinstance(config, str):
            if len(config) > MAX_CONFIG_BYTES:
                raise InvalidArgument(f"config_json has {len(config):,} characters; at most {MAX_CONFIG_BYTES:,} "
                                      "(a config names files, it does not carry data)")
            # every way the caller's JSON can fail (too deeply nested, an integer of 5,000 digits...) is theirs
            config = jsonbody.loads(config, "config_json") if config.strip() else {}
        elif config is not None:
            # a mapping from an in-process caller: the same rule as for config_json (jsonbody.loads checked that),
            # before any of its strings is used as a path or an endpoint
            check_strings(config, "config")
        if config is None:
            config = {}
        if isinstance(config, dict) and self.service_addresses:
            # the deployment's addresses for what the job leaves unset (its 127.0.0.1 defaults reach nothing
            # in a container); only fields this stage's config has
            fields = {f.name for f in dataclasses.fields(stage.config_cls)}
            config = {**{k: v for k, v in self.service_addresses.items() if k in fields}, **config}
        with paths_of_the_config():
            if isinstance(config, dict):
                # before the config's own validation, which may look at the paths it names (is_dir...)
                self.check(stage, config)
            cfg = validate_config(stage, config)
            cfg_dict = to_dict(cfg)
            self.check(stage, cfg_dict)  # the defaults too
            # a job whose memory estimate exceeds its GPU is refused now, with what would fit (memory_check)
            if self.memory_check:
                check_fits(stage.name, cfg)
        return cfg, cfg_dict, canonical_json(cfg_dict)

    def check(self, stage: Stage, config: dict) -> None:
        """Names, paths and endpoints the config names (prorag.validation); InvalidArgument naming the field.
        INVALID_ARGUMENT rather than PERMISSION_DENIED: the allowlist and the data root bind every caller
        alike, so no other credentials would make this request acceptable; only a changed config would."""
        check_job_config(stage, config, roots=data_roots([self.jobs_root]), allowed_endpoints=self.allowed_endpoints)

    @staticmethod
    def job_id(stage: Stage, job_id: str) -> str:
        """The caller's job id once checked, or a new unique one when it gave none."""
        if not job_id:
            return f"{stage.name}-{_dt.datetime.now(_dt.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
        if not JOB_ID_RE.match(job_id):
            raise InvalidArgument(f"job_id {job_id!r}: use 1-128 letters, digits, '.', '_' or '-', "
                                  "starting with a letter or digit")
        return job_id
