"""S3 (or any S3-compatible endpoint) as the adapter store: `<prefix>/<key>/<file>`.

`put` uploads the weights first and the config last: a config object marks a complete
adapter, so a crashed put leaves an object `exists`/`fetch` never report as an adapter, which
the collector of unreferenced objects removes (`list_objects` lists it). Files above
`multipart_threshold` go up in parts (S3 refuses single PUTs over 5 GiB, and parts retry
independently).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import boto3
from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
)

from loraplex.platform.store.base import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterNotFound,
    AdapterStore,
    MiB,
    StoredObject,
    StoreError,
    check_key,
    new_key,
    verify_digest,
)

_DENIED = {
    "403",
    "AccessDenied",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
}
_MISSING_BUCKET = {"NoSuchBucket"}
_MISSING_KEY = {"404", "NoSuchKey", "NotFound"}


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


class S3Store(AdapterStore):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        multipart_threshold: int = 8 * MiB,
        multipart_chunksize: int = 8 * MiB,
    ):
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.endpoint_url = endpoint_url
        # S3-compatible servers (MinIO, Ceph, moto) rarely have per-bucket DNS names.
        style = "path" if endpoint_url else "auto"
        config = Config(
            s3={"addressing_style": style},
            retries={"max_attempts": 3, "mode": "standard"},
            connect_timeout=10,
            read_timeout=60,
        )
        # None lets boto3 fall back to its usual chain (env, ~/.aws, instance role).
        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            config=config,
        )
        # S3 requires parts of at least 5 MiB; s3transfer raises smaller chunk sizes to that.
        self.transfer = TransferConfig(
            multipart_threshold=multipart_threshold, multipart_chunksize=multipart_chunksize
        )

    def __repr__(self) -> str:
        return f"S3Store({self._where()!r})"

    def _where(self) -> str:
        url = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        return f"{url} at {self.endpoint_url}" if self.endpoint_url else url

    def _object(self, key: str, name: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}/{name}" if self.prefix else f"{key}/{name}"

    def _error(self, e: BaseException, doing: str) -> StoreError:
        """Turn a boto error into a StoreError that says what the operator should check."""
        # upload_file wraps a ClientError in S3UploadFailedError (raised while handling it).
        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, (ClientError, BotoCoreError)):
            cause = cause.__cause__ or cause.__context__
        where = self._where()
        if isinstance(cause, ClientError):
            code = _code(cause)
            if code in _MISSING_BUCKET:
                return self._no_bucket(doing)
            if code in _DENIED:
                return StoreError(
                    f"{doing}: access denied to {where} ({code}); check the access key and "
                    "secret, the region, and that the key's policy allows s3:GetObject, "
                    "s3:PutObject, s3:DeleteObject and s3:ListBucket on this bucket/prefix"
                )
            return StoreError(f"{doing}: S3 error {code} on {where}: {cause}")
        if isinstance(cause, (NoCredentialsError, PartialCredentialsError)):
            return StoreError(
                f"{doing}: no S3 credentials for {where}; set the store's access key and "
                "secret (or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
            )
        if isinstance(cause, EndpointConnectionError):
            return StoreError(
                f"{doing}: cannot reach the S3 endpoint for {where}; check the endpoint URL "
                "and the network"
            )
        return StoreError(f"{doing}: {e} ({where})")

    def _no_bucket(self, doing: str) -> StoreError:
        return StoreError(
            f"{doing}: bucket {self.bucket!r} does not exist ({self._where()}); create it or "
            "fix the store URL / endpoint URL"
        )

    def _missing(self, key: str, doing: str) -> StoreError:
        # HEAD answers a bare 404 for a missing bucket too; ask the bucket to tell them apart.
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            if _code(e) in _MISSING_KEY:
                return self._no_bucket(doing)
            return self._error(e, doing)
        except BotoCoreError as e:
            return self._error(e, doing)
        return AdapterNotFound(f"no adapter {key} in {self._where()}")

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._object(key, CONFIG_FILE))
        except ClientError as e:
            if _code(e) in _MISSING_KEY:
                err = self._missing(key, f"looking up adapter {key}")
                if isinstance(err, AdapterNotFound):
                    return False
                raise err from None
            raise self._error(e, f"looking up adapter {key}") from None
        except BotoCoreError as e:
            raise self._error(e, f"looking up adapter {key}") from None
        return True

    def put(self, folder: Path, digest: str) -> str:
        folder = Path(folder)
        verify_digest(folder, digest)
        key = new_key(digest)
        try:
            for name in (WEIGHTS_FILE, CONFIG_FILE):  # config last: it marks completeness
                self.client.upload_file(
                    str(folder / name),
                    self.bucket,
                    self._object(key, name),
                    Config=self.transfer,
                )
        except (ClientError, BotoCoreError, Boto3Error) as e:
            raise self._error(e, f"uploading adapter {digest}") from None
        return key

    def fetch(self, key: str, dest: Path) -> Path:
        if not self.exists(key):
            raise AdapterNotFound(f"no adapter {key} in {self._where()}")
        dest = self._check_dest(dest)
        tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=dest.parent))
        try:
            for name in (CONFIG_FILE, WEIGHTS_FILE):
                self.client.download_file(
                    self.bucket, self._object(key, name), str(tmp / name), Config=self.transfer
                )
            os.replace(tmp, dest)
        except ClientError as e:
            if _code(e) in _MISSING_KEY:
                # Deleted between the exists check and the download.
                raise AdapterNotFound(f"no adapter {key} in {self._where()}") from None
            raise self._error(e, f"downloading adapter {key}") from None
        except (BotoCoreError, Boto3Error) as e:
            raise self._error(e, f"downloading adapter {key}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    def delete(self, key: str) -> None:
        try:
            for name in (CONFIG_FILE, WEIGHTS_FILE):  # config first: incomplete at once
                self.client.delete_object(Bucket=self.bucket, Key=self._object(key, name))
        except (ClientError, BotoCoreError) as e:
            raise self._error(e, f"deleting adapter {key}") from None

    def list_objects(self) -> Iterator[StoredObject]:
        base = f"{self.prefix}/" if self.prefix else ""
        newest: dict[str, float] = {}  # key -> its newest file's time
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    key, _, name = obj["Key"][len(base) :].partition("/")
                    try:
                        check_key(key)
                    except ValueError:
                        continue  # not ours: other tools may share the bucket
                    if name:
                        t = obj["LastModified"].timestamp()
                        newest[key] = max(newest.get(key, t), t)
        except (ClientError, BotoCoreError) as e:
            raise self._error(e, "listing the adapter store") from None
        for key, modified in newest.items():
            yield StoredObject(key, modified)

    def check(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            if _code(e) in _MISSING_KEY:
                raise self._no_bucket("checking the adapter store") from None
            raise self._error(e, "checking the adapter store") from None
        except BotoCoreError as e:
            raise self._error(e, "checking the adapter store") from None
