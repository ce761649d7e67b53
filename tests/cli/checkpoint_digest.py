#!/usr/bin/python3
"""Prints a digest of the tensors in a checkpoint's payload: `N SHA256`, N the
number of tensor storages and SHA256 the hash of their sorted SHA-256s.

    checkpoint_digest.py CHECKPOINT

The payload (include/attnkit/train/checkpoint.h) is a torch::serialize archive,
a zip whose data/<k> records hold the raw bytes of every stored tensor: the
model's parameters and buffers, the optimiser's state and the CPU generator's
state. libtorch keys the optimiser's state by the parameters' TensorImpl
addresses, which differ from process to process and reorder the archive, so
two runs that end in the same state do not write the same payload bytes; the
multiset of the storages' bytes is what they share. Standard library only.
"""
import hashlib
import io
import struct
import sys
import zipfile


def main(path):
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"ATNKCKPT":
        sys.exit(f"{path}: not an attnkit checkpoint")
    header, payload = struct.unpack("<QQ", data[12:28])
    archive = zipfile.ZipFile(io.BytesIO(data[28 + header:28 + header + payload]))
    storages = sorted(hashlib.sha256(archive.read(name)).hexdigest()
                      for name in archive.namelist() if "/data/" in name)
    print(len(storages), hashlib.sha256("".join(storages).encode()).hexdigest())


if __name__ == "__main__":
    main(sys.argv[1])
