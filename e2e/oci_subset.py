"""Turn a docker-archive (what `buildah push docker-archive:` writes: uncompressed layers named by their digest)
into an OCI archive for `ctr images import` holding only the layers containerd's content store lacks.

    python3 e2e/oci_subset.py DOCKER_ARCHIVE OUT_TAR REF HAVE_DIR

The manifest lists every layer (uncompressed, digest = diff ID, true size); layers whose blob is already in
HAVE_DIR (containerd's blobs/sha256, named by digest) are left out of OUT_TAR: the import finds them in the
content store, and their snapshots are unpacked already. So a 6 GB torch layer shared by the worker and
worker-vllm images, or unchanged under a source edit, crosses once. (buildah 1.28 gzips every layer it writes
to an `oci:`/`oci-archive:` destination, --disable-compression or not: on two loaded cores that was most of the
import's time, and a gzip digest never matches a layer another image brought uncompressed.) Stdlib only."""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"


def _add_bytes(out: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    out.addfile(info, io.BytesIO(data))


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def subset(src: Path, dst: Path, ref: str, have: Path) -> tuple[int, int]:
    """Writes dst; returns (layers written, layers left out)."""
    with tarfile.open(src) as arc:
        (entry,) = json.loads(arc.extractfile("manifest.json").read())  # type: ignore[union-attr]
        config = arc.extractfile(entry["Config"]).read()  # type: ignore[union-attr]
        diff_ids = json.loads(config)["rootfs"]["diff_ids"]
        if len(diff_ids) != len(entry["Layers"]):
            raise SystemExit(f"{src}: {len(entry['Layers'])} layers but {len(diff_ids)} diff IDs")
        members = [arc.getmember(name) for name in entry["Layers"]]
        for name, diff_id in zip(entry["Layers"], diff_ids, strict=True):
            # c/image names each uncompressed layer by its digest: the blob's name in the OCI layout
            if Path(name).stem != diff_id.split(":", 1)[1]:
                raise SystemExit(f"{src}: layer {name} is not named by its diff ID {diff_id}")
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": _digest(config), "size": len(config)},
            "layers": [{"mediaType": OCI_LAYER, "digest": d, "size": m.size} for d, m in zip(diff_ids, members,
                                                                                             strict=True)],
        }, separators=(",", ":")).encode()
        index = json.dumps({"schemaVersion": 2, "manifests": [{
            "mediaType": OCI_MANIFEST, "digest": _digest(manifest), "size": len(manifest),
            "annotations": {"org.opencontainers.image.ref.name": ref}}]}, separators=(",", ":")).encode()
        written = skipped = 0
        with tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as out:
            _add_bytes(out, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
            _add_bytes(out, "index.json", index)
            _add_bytes(out, f"blobs/sha256/{_digest(manifest)[7:]}", manifest)
            _add_bytes(out, f"blobs/sha256/{_digest(config)[7:]}", config)
            done: set[str] = set()
            for diff_id, m in zip(diff_ids, members, strict=True):
                hexd = diff_id.split(":", 1)[1]
                if hexd in done:
                    continue
                done.add(hexd)
                if (have / hexd).is_file() and (have / hexd).stat().st_size == m.size:
                    skipped += 1
                    continue
                info = tarfile.TarInfo(f"blobs/sha256/{hexd}")
                info.size, info.mode = m.size, 0o644
                out.addfile(info, arc.extractfile(m))
                written += 1
    return written, skipped


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    written, skipped = subset(Path(argv[1]), Path(argv[2]), argv[3], Path(argv[4]))
    print(f"{written} layers written, {skipped} already in the content store")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
