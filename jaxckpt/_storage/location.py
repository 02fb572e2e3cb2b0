"""Where a checkpoint lives: a ``Location`` from a local path, an ``s3://``, ``gs://`` or
``memory://`` URL, or a raw tensorstore kvstore spec; and which keys stay inside it
(pure: no storage I/O; it reads environment variables and the AWS profile files).

On S3 the usual AWS conventions apply where tensorstore does not follow them itself
(docs/storage.md has the table): ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` give the
endpoint, ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` (or the profile's ``region``) the
region, and the credentials come from the environment, a profile of the shared files,
ECS, or the default chain, chosen as the AWS SDKs would. Whatever a spec dict gives
explicitly wins over the environment.
"""

from __future__ import annotations

import configparser
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from .._errors import CheckpointError

_SAFE_KEY = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")


def is_safe_key(key: str) -> bool:
    """True when ``key`` is a relative path that stays inside the checkpoint."""
    return bool(_SAFE_KEY.match(key)) and not any(p in (".", "..") for p in key.split("/"))


@dataclass(frozen=True)
class Location:
    """A checkpoint's root: a local directory or a prefix in a kvstore."""

    spec: tuple[tuple[str, Any], ...]  # the kvstore spec; "path" ends with "/"
    local: str | None  # absolute local directory, when the kvstore is a local file system
    # tensorstore context resources the store needs (JSON): the AWS credentials chosen
    # from the environment when the spec names none. Resources, not spec members, so a
    # location's kvstore spec stays what was asked for.
    resources: str = ""

    def __hash__(self) -> int:  # a spec dict may hold nested dicts
        return hash((json.dumps(self.spec, sort_keys=True, default=str), self.local, self.resources))

    @property
    def kvstore(self) -> dict[str, Any]:
        return dict(self.spec)

    @property
    def context_spec(self) -> dict[str, Any]:
        """Context resources the store's ``ts.Context`` starts from (may be empty)."""
        return json.loads(self.resources) if self.resources else {}

    def child(self, key: str) -> Location:
        spec = self.kvstore
        spec["path"] = spec.get("path", "") + key.strip("/") + "/"
        local = os.path.join(self.local, key) if self.local is not None else None
        return Location(tuple(sorted(spec.items())), local, self.resources)

    def parent(self) -> Location:
        """The location one level up (a step's manager directory)."""
        spec = self.kvstore
        spec["path"] = spec.get("path", "").rstrip("/").rpartition("/")[0]
        spec["path"] += "/" if spec["path"] else ""
        local = os.path.dirname(self.local.rstrip(os.sep)) if self.local is not None else None
        return Location(tuple(sorted(spec.items())), local, self.resources)

    def key_spec(self, key: str) -> dict[str, Any]:
        spec = self.kvstore
        spec["path"] = spec.get("path", "") + key
        return spec

    @property
    def url(self) -> str:
        if self.local is not None:
            return self.local
        spec = self.kvstore
        driver = spec["driver"]
        if driver in ("s3", "gcs"):
            scheme = "s3" if driver == "s3" else "gs"
            return f"{scheme}://{spec['bucket']}/{spec.get('path', '')}".rstrip("/")
        return f"{driver}://{spec.get('path', '')}".rstrip("/")

    def __str__(self) -> str:
        return self.url


def resolve(path: Any) -> Location:
    """A ``Location`` from a path, URL (``s3://b/p``, ``gs://b/p``, ``memory://p``,
    ``file://p``) or a tensorstore kvstore spec dict (e.g. an ``s3`` spec with an
    ``endpoint``). An ``s3`` location takes what its spec leaves out (endpoint, region,
    credentials) from the AWS environment variables and profile files."""
    if isinstance(path, Location):
        return path
    if isinstance(path, dict):
        spec = dict(path)
        if spec.get("driver") == "file":
            return resolve(spec["path"])
        spec["path"] = spec.get("path", "").strip("/") + "/" if spec.get("path", "").strip("/") else ""
        return _remote(spec)
    text = os.fspath(path)
    if "://" not in text or text.startswith("file://"):
        local = os.path.abspath(text.removeprefix("file://"))
        return Location((("driver", "file"), ("path", local.rstrip("/") + "/")), local)
    scheme, rest = text.split("://", 1)
    if scheme in ("s3", "gs"):
        bucket, _, prefix = rest.partition("/")
        prefix = prefix.strip("/")
        spec = {"driver": "s3" if scheme == "s3" else "gcs", "bucket": bucket,
                "path": prefix + "/" if prefix else ""}
        return _remote(spec)
    if scheme == "memory":
        rest = rest.strip("/")
        return Location((("driver", "memory"), ("path", rest + "/" if rest else "")), None)
    raise CheckpointError(f"unsupported checkpoint location {text!r}")


def _remote(spec: dict[str, Any]) -> Location:
    """A non-local location; an ``s3`` one completed from the AWS environment."""
    resources = ""
    if spec.get("driver") == "s3":
        spec = s3_from_env(spec)
        given = isinstance(spec.get("context"), dict) and "aws_credentials" in spec["context"]
        credentials = None if "aws_credentials" in spec or given else aws_credentials()
        if credentials is not None:
            resources = json.dumps({"aws_credentials": credentials}, sort_keys=True)
    return Location(tuple(sorted(spec.items())), None, resources)


# --- the AWS conventions tensorstore's s3 driver does not follow itself --------------

# Keys of a profile that let the AWS SDK's profile provider make credentials by itself.
_PROFILE_CREDENTIALS = ("aws_access_key_id", "role_arn", "credential_process")


def _env(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def aws_profile_files() -> tuple[str, str, str]:
    """``(profile, credentials file, config file)`` as the AWS SDKs find them."""
    profile = _env("AWS_PROFILE") or _env("AWS_DEFAULT_PROFILE") or "default"
    credentials = os.path.expanduser(_env("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials")
    config = os.path.expanduser(_env("AWS_CONFIG_FILE") or "~/.aws/config")
    return profile, credentials, config


def _ini_section(path: str, section: str) -> dict[str, str]:
    """One section of an AWS ini file; empty when the file or section is missing or
    unreadable (the SDK then reports what is wrong with it, if it reads it at all)."""
    if not os.path.isfile(path):
        return {}
    parser = configparser.RawConfigParser(strict=False, default_section="\0", interpolation=None)
    try:
        parser.read(path, encoding="utf-8")
    except (configparser.Error, OSError, UnicodeDecodeError):
        return {}
    return dict(parser[section]) if parser.has_section(section) else {}


def aws_profile(profile: str, credentials: str, config: str) -> dict[str, str]:
    """A profile's keys: its config file section, overridden by its credentials file one."""
    keys = _ini_section(config, "default" if profile == "default" else f"profile {profile}")
    keys.update(_ini_section(credentials, profile))
    return keys


def s3_from_env(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with the endpoint and region it leaves out taken from the environment
    (``AWS_ENDPOINT_URL_S3`` over ``AWS_ENDPOINT_URL``; ``AWS_REGION`` over
    ``AWS_DEFAULT_REGION`` over the profile's ``region``)."""
    out = dict(spec)
    ignore = (_env("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS") or "").lower() == "true"
    endpoint = None if ignore else _env("AWS_ENDPOINT_URL_S3") or _env("AWS_ENDPOINT_URL")
    if "endpoint" not in out and endpoint:
        out["endpoint"] = endpoint.rstrip("/")
    if "aws_region" not in out:
        region = _env("AWS_REGION") or _env("AWS_DEFAULT_REGION") or aws_profile(*aws_profile_files()).get("region")
        if region:
            out["aws_region"] = region
    return out


def aws_credentials() -> dict[str, Any] | None:
    """The tensorstore ``aws_credentials`` resource the environment calls for, in the
    AWS SDKs' order, or ``None`` for tensorstore's default chain.

    Named explicitly because tensorstore 0.1.86 passes unset ``profile`` and file
    fields to the AWS SDK as empty overrides (``AWS_PROFILE`` and the file variables are
    then not honoured), and because its default chain logs errors for every missing
    ``~/.aws`` file: keys in the environment need no files; a profile file that is
    missing is replaced by ``os.devnull``.
    """
    if _env("AWS_ACCESS_KEY_ID") and _env("AWS_SECRET_ACCESS_KEY"):
        return {"type": "environment"}
    profile, credentials, config = aws_profile_files()
    if _env("AWS_WEB_IDENTITY_TOKEN_FILE"):  # only the default chain assumes a web identity
        return {"type": "default", "profile": profile}
    if any(k in aws_profile(profile, credentials, config) for k in _PROFILE_CREDENTIALS):
        return {"type": "profile", "profile": profile,
                "credentials_file": credentials if os.path.isfile(credentials) else os.devnull,
                "config_file": config if os.path.isfile(config) else os.devnull}
    if _env("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or _env("AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        return {"type": "ecs"}
    if _env("AWS_PROFILE") or os.path.isfile(credentials) or os.path.isfile(config):
        return {"type": "default", "profile": profile}  # SSO and other profile kinds
    return None
