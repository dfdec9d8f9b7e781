#!/bin/bash
set -euo pipefail
python3 - <<'PY'
import csv
import json
from decimal import Decimal

regions = {}
with open("/app/data/orders.csv", newline="") as handle:
    for row in csv.DictReader(handle):
        if row["status"].strip().lower() == "cancelled":
            continue
        region = regions.setdefault(
            row["region"].strip().lower(), {"orders": 0, "units": 0, "revenue": Decimal(0)}
        )
        quantity = int(row["quantity"])
        region["orders"] += 1
        region["units"] += quantity
        region["revenue"] += quantity * Decimal(row["unit_price"])
total = sum(r["revenue"] for r in regions.values())
for region in regions.values():
    region["revenue"] = float(round(region["revenue"], 2))
summary = {"regions": regions, "total_revenue": float(round(total, 2))}
with open("/app/summary.json", "w") as handle:
    json.dump(summary, handle, indent=2, sort_keys=True)
PY
