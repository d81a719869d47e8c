"""Read W&B's offline `run-<id>.wandb` files (there is no public reader in wandb 0.31).

The file is a leveldb-style log: a 7-byte header (`:W&B`, a 2-byte magic, a 1-byte version),
then 32 KiB blocks of chunks `crc32 (4) | length (2) | type (1) | data`. A chunk never starts in
the last 6 bytes of a block (they are zero padding); a record longer than a block's room is
split into FIRST, MIDDLE..., LAST chunks. Each whole record is a serialized
`wandb.proto.wandb_internal_pb2.Record`. Checksums are verified, so a misparse fails loudly
instead of returning garbage.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

HEADER = b":W&B"
FILE_HEADER_LEN = 7
CHUNK_HEADER_LEN = 7
BLOCK_LEN = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _chunks(data: bytes) -> list[tuple[int, bytes]]:
    """(type, payload) of every chunk after the file header, checksums verified."""
    if data[:4] != HEADER:
        raise ValueError(f"not a .wandb file: header {data[:7]!r}")
    out, pos = [], FILE_HEADER_LEN
    while pos < len(data):
        room = BLOCK_LEN - pos % BLOCK_LEN
        if room < CHUNK_HEADER_LEN:  # block trailer: zero padding
            pos += room
            continue
        if pos + CHUNK_HEADER_LEN > len(data):
            break
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER_LEN])
        if crc == 0 and length == 0 and kind == 0:  # preallocated / padded tail
            pos += room
            continue
        payload = data[pos + CHUNK_HEADER_LEN : pos + CHUNK_HEADER_LEN + length]
        if len(payload) < length:
            raise ValueError(f"truncated chunk at offset {pos}")
        expected = zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF
        if crc != expected:
            raise ValueError(f"checksum mismatch at offset {pos}")
        out.append((kind, payload))
        pos += CHUNK_HEADER_LEN + length
    return out


def read_records(path: Path) -> list[wandb_internal_pb2.Record]:
    """Every record of a `.wandb` file, in write order."""
    records, pending = [], b""
    for kind, payload in _chunks(Path(path).read_bytes()):
        if kind == FULL:
            whole = payload
        elif kind == FIRST:
            pending = payload
            continue
        elif kind == MIDDLE:
            pending += payload
            continue
        elif kind == LAST:
            whole, pending = pending + payload, b""
        else:
            raise ValueError(f"unknown chunk type {kind}")
        record = wandb_internal_pb2.Record()
        record.ParseFromString(whole)
        records.append(record)
    return records


def history(path: Path) -> list[dict[str, Any]]:
    """The logged history rows (`run.log` calls), values decoded from their JSON."""
    rows = []
    for record in read_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        rows.append(row)
    return rows


def run_id(path: Path) -> str:
    """The run id stored in the file's run record."""
    for record in read_records(path):
        if record.WhichOneof("record_type") == "run":
            return record.run.run_id
    raise ValueError(f"{path} holds no run record")
