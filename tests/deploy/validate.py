#!/usr/bin/env python3
"""Validates rendered Kubernetes manifests offline, strictly (unknown fields
are errors), against the API schemas of each Kubernetes version given.

Built-in kinds are checked with kubernetes-validate (which ships the
schemas); VolumeSnapshotClass and VolumeGroupSnapshotClass (CRDs of the
snapshot controller), SnapshotMetadataService (external-snapshot-metadata's
CRD) and PodMonitor (prometheus-operator's) with the schemas beside this
script. Any other kind is an error: a manifest this cannot check does not
pass.

usage: validate.py -k 1.34.0 [-k 1.37.0] FILE...
"""
import argparse
import json
import os
import sys

import jsonschema
import kubernetes_validate
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
CRDS = {
    ("snapshot.storage.k8s.io/v1", "VolumeSnapshotClass"): "volumesnapshotclass.json",
    ("groupsnapshot.storage.k8s.io/v1", "VolumeGroupSnapshotClass"): "volumegroupsnapshotclass.json",
    ("cbt.storage.k8s.io/v1beta1", "SnapshotMetadataService"): "snapshotmetadataservice.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.json",
}


def check(doc, version):
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRDS:
        with open(os.path.join(HERE, CRDS[key])) as f:
            jsonschema.validate(doc, json.load(f))
        return
    kubernetes_validate.validate(doc, version, strict=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-k", "--kubernetes-version", action="append", required=True)
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    failures = 0
    checked = 0
    for path in args.files:
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d is not None]
        for doc in docs:
            name = "{} {}/{}".format(
                path, doc.get("kind"), (doc.get("metadata") or {}).get("name")
            )
            for version in args.kubernetes_version:
                try:
                    check(doc, version)
                    checked += 1
                except Exception as e:  # every failure is reported, then counted
                    failures += 1
                    message = getattr(e, "message", None) or str(e)
                    print("FAIL {} (Kubernetes {}): {}".format(name, version, message))
    print("{} checked, {} failed".format(checked, failures))
    return 1 if failures or not checked else 0


if __name__ == "__main__":
    sys.exit(main())
