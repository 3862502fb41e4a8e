#!/usr/bin/env python3
"""Renders and lints deploy/chart offline with Helm's own library (the
PyPI package helm-python-sdk, which carries Helm v4 as a shared library:
no helm binary, no cluster).

usage: chart.py render VALUES.json [--name N] [--namespace NS]
       chart.py notes VALUES.json [--name N] [--namespace NS]
       chart.py lint VALUES.json [--kube-version 1.34.0]

VALUES.json holds the values given over the chart's defaults (as helm's
--values would); `-` reads them from stdin. `render` prints the manifests
as one YAML stream (as `helm template` does, NOTES.txt left out); `notes`
prints NOTES.txt as `helm install` shows it (offline: `lookup` finds
nothing); `lint`
prints the lint report as JSON and fails on any warning or error.
"""
import argparse
import json
import os
import sys

import helm_python

CHART = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "deploy", "chart")


def values(path):
    with (sys.stdin if path == "-" else open(path)) as f:
        return json.load(f)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["render", "notes", "lint"])
    parser.add_argument("values")
    parser.add_argument("--name", default="ferrovol")
    parser.add_argument("--namespace", default="ferrovol")
    parser.add_argument("--kube-version", default="1.34.0")
    args = parser.parse_args()
    given = values(args.values)
    if args.command in ("render", "notes"):
        chart = helm_python.Chart.load(CHART)
        try:
            out = chart.render(given, name=args.name, namespace=args.namespace, is_install=True)
        except helm_python.HelmError as e:
            print(e, file=sys.stderr)
            return 1
        if args.command == "notes":
            sys.stdout.write(next(v for k, v in out.items() if k.endswith("NOTES.txt")))
            return 0
        for path in sorted(out):
            if path.endswith("NOTES.txt") or not out[path].strip():
                continue
            sys.stdout.write("---\n# Source: {}\n{}\n".format(path, out[path].strip("\n")))
        return 0
    report = helm_python.lint(
        CHART, given, strict=True, namespace=args.namespace, kube_version="v" + args.kube_version
    )
    print(json.dumps(report, indent=1))
    bad = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
