"""A small kustomize renderer for the subset deploy/ uses, so the manifest tests need no binary.

Design: kustomize itself is not on PyPI or in Debian's main archive, so the tests render the
overlays with this module and, where ``kubectl kustomize`` exists, check that both renderings
agree (test_deploy_manifests.py). deploy/ keeps to what is implemented here, and this module
raises :class:`UnsupportedKustomization` on anything else rather than rendering it wrongly:

- ``resources`` (files and folders holding a kustomization), ``components``
- ``namespace`` (set on every namespaced object)
- ``images`` (``newName`` / ``newTag``)
- ``configMapGenerator`` / ``secretGenerator`` with ``files`` and ``literals``, ``options.labels``,
  ``generatorOptions.disableNameSuffixHash``; a content-hash suffix otherwise, and references to
  the generated name rewritten in pod specs (volumes, envFrom, env valueFrom)
- ``patches`` given by ``path``, each a strategic-merge patch that names its target by
  apiVersion/kind/metadata.name; ``$patch: delete`` removes the target. Lists merge by the
  Kubernetes patch-merge key for the lists deploy/ patches (containers, env, volumes, ...);
  other lists are replaced, as in kustomize.

The hash suffix differs from kustomize's (a different hash function); comparisons strip it.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

Doc = dict[str, Any]

KNOWN_FIELDS = {
    "apiVersion",
    "kind",
    "namespace",
    "resources",
    "components",
    "images",
    "patches",
    "configMapGenerator",
    "secretGenerator",
    "generatorOptions",
}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}
# Strategic-merge keys of the lists deploy/ patches (from the Kubernetes API's patchMergeKey).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "envFrom": None,
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
}


class UnsupportedKustomization(ValueError):
    """The kustomization uses a feature this renderer does not implement."""


def _load_docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _group(api_version: str) -> str:
    return api_version.split("/")[0] if "/" in api_version else ""


def _key(doc: Doc) -> tuple[str, str, str]:
    return (_group(doc["apiVersion"]), doc["kind"], doc["metadata"]["name"])


def _suffix(data: Doc) -> str:
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
    return digest[:10]


def _generate(root: Path, spec: Doc, kind: str, options: Doc) -> tuple[Doc, str]:
    unknown = set(spec) - {"name", "files", "literals", "options"}
    if unknown:
        raise UnsupportedKustomization(f"{kind} generator fields {sorted(unknown)} are not supported")
    data: dict[str, str] = {}
    for item in spec.get("files", []):
        key, _, rel = item.rpartition("=") if "=" in item else ("", "", item)
        path = root / rel
        data[key or path.name] = path.read_text()
    for item in spec.get("literals", []):
        key, _, value = item.partition("=")
        data[key] = value
    opts = {**options, **spec.get("options", {})}
    name = spec["name"]
    doc: Doc = {"apiVersion": "v1", "kind": kind, "metadata": {"name": name}}
    if opts.get("labels"):
        doc["metadata"]["labels"] = dict(opts["labels"])
    if kind == "Secret":
        doc["type"] = "Opaque"
        doc["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    else:
        doc["data"] = data
    if not opts.get("disableNameSuffixHash", False):
        doc["metadata"]["name"] = f"{name}-{_suffix(doc['data'])}"
    return doc, name


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """Merge ``patch`` into ``base`` (both plain YAML values) the way a strategic-merge patch does."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if k.startswith("$"):
                raise UnsupportedKustomization(f"directive {k} inside an object is not supported")
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = strategic_merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and MERGE_KEYS.get(field):
        # kustomize (kyaml) puts the patch's items first, in the patch's order, merged with their
        # base counterpart, then the base items the patch does not name; matching that order keeps
        # the comparison with `kubectl kustomize` exact (env order matters for $(VAR) references).
        key = MERGE_KEYS[field]
        named = {item.get(key) for item in patch if isinstance(item, dict)}
        out = []
        for item in patch:
            match = [x for x in base if isinstance(x, dict) and x.get(key) == item.get(key)]
            out.append(strategic_merge(match[0], item, field) if match else copy.deepcopy(item))
        out += [copy.deepcopy(x) for x in base if not (isinstance(x, dict) and x.get(key) in named)]
        return out
    return copy.deepcopy(patch)


def _pod_spec(doc: Doc) -> Doc | None:
    if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        return doc["spec"]["template"]["spec"]
    if doc["kind"] == "Pod":
        return doc["spec"]
    return None


def _rename_refs(docs: list[Doc], renames: dict[tuple[str, str], str]) -> None:
    """Point pod specs at generated names: renames maps (kind, old name) -> new name."""
    for doc in docs:
        spec = _pod_spec(doc)
        if spec is None:
            continue
        for vol in spec.get("volumes", []):
            if "configMap" in vol:
                vol["configMap"]["name"] = renames.get(
                    ("ConfigMap", vol["configMap"]["name"]), vol["configMap"]["name"]
                )
            if "secret" in vol:
                s = vol["secret"]["secretName"]
                vol["secret"]["secretName"] = renames.get(("Secret", s), s)
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            for ef in c.get("envFrom", []):
                for kind, field in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                    if field in ef:
                        ef[field]["name"] = renames.get((kind, ef[field]["name"]), ef[field]["name"])
            for ev in c.get("env", []):
                ref = ev.get("valueFrom", {})
                for kind, field in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
                    if field in ref:
                        ref[field]["name"] = renames.get((kind, ref[field]["name"]), ref[field]["name"])


def _apply_patches(docs: list[Doc], patches: list[Doc], where: Path) -> list[Doc]:
    for patch in patches:
        k = _key(patch)
        idx = [i for i, d in enumerate(docs) if _key(d) == k]
        if len(idx) != 1:
            raise UnsupportedKustomization(f"{where}: patch target {k} matched {len(idx)} resources")
        if patch.get("$patch") == "delete":
            del docs[idx[0]]
            continue
        body = {k2: v for k2, v in patch.items() if k2 not in ("apiVersion", "kind")}
        body["metadata"] = {k2: v for k2, v in patch["metadata"].items() if k2 != "name"}
        if not body["metadata"]:
            del body["metadata"]
        docs[idx[0]] = strategic_merge(docs[idx[0]], body)
    return docs


def _images(docs: list[Doc], images: list[Doc]) -> None:
    for doc in docs:
        spec = _pod_spec(doc)
        if spec is None:
            continue
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            for img in images:
                name = c["image"].split("@")[0].rsplit(":", 1)[0] if ":" in c["image"] else c["image"]
                if name == img["name"]:
                    new = img.get("newName", name)
                    c["image"] = f"{new}:{img['newTag']}" if "newTag" in img else new


def render(root: str | Path, _renames: dict[tuple[str, str], str] | None = None) -> list[Doc]:
    """Render the kustomization (or component) in folder ``root`` into a list of objects."""
    root = Path(root)
    kfile = root / "kustomization.yaml"
    spec = yaml.safe_load(kfile.read_text())
    unknown = set(spec) - KNOWN_FIELDS
    if unknown:
        raise UnsupportedKustomization(f"{kfile}: fields {sorted(unknown)} are not supported")
    renames: dict[tuple[str, str], str] = {} if _renames is None else _renames
    docs: list[Doc] = []
    for res in spec.get("resources", []):
        p = root / res
        docs += render(p, renames) if p.is_dir() else _load_docs(p)
    options = spec.get("generatorOptions", {})
    for kind, field in (("ConfigMap", "configMapGenerator"), ("Secret", "secretGenerator")):
        for gen in spec.get(field, []):
            doc, original = _generate(root, gen, kind, options)
            docs.append(doc)
            renames[(kind, original)] = doc["metadata"]["name"]
    for comp in spec.get("components", []):
        docs = _apply_component(docs, root / comp, renames)
    patch_docs: list[Doc] = []
    for p in spec.get("patches", []):
        if set(p) != {"path"}:
            raise UnsupportedKustomization(f"{kfile}: only `patches: - path:` is supported, got {p}")
        patch_docs += _load_docs(root / p["path"])
    docs = _apply_patches(docs, patch_docs, kfile)
    _images(docs, spec.get("images", []))
    if "namespace" in spec:
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = spec["namespace"]
    _rename_refs(docs, renames)
    return docs


def _apply_component(docs: list[Doc], root: Path, renames: dict[tuple[str, str], str]) -> list[Doc]:
    spec = yaml.safe_load((root / "kustomization.yaml").read_text())
    if spec.get("kind") != "Component":
        raise UnsupportedKustomization(f"{root} is listed under components but is a {spec.get('kind')}")
    unknown = set(spec) - {"apiVersion", "kind", "resources", "patches"}
    if unknown:
        raise UnsupportedKustomization(f"{root}: component fields {sorted(unknown)} are not supported")
    docs = docs + [d for res in spec.get("resources", []) for d in _load_docs(root / res)]
    patch_docs = [d for p in spec.get("patches", []) for d in _load_docs(root / p["path"])]
    return _apply_patches(docs, patch_docs, root)
