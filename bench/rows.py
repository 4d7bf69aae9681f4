"""The results file the bench/compare_*.sh drivers write (bench/common.sh's
time_row): one line per run, "row<TAB>run<TAB>JSON", a "_peak" row for the
machine's measured peak."""
import json


class Rows:
    def __init__(self, path):
        self.runs, self.order, self.peak = {}, [], None
        for line in open(path):
            row, _run, js = line.rstrip("\n").split("\t", 2)
            d = json.loads(js)
            if row == "_peak":
                self.peak = d
                continue
            self.runs.setdefault(row, []).append(d)
            if row not in self.order:
                self.order.append(row)

    @staticmethod
    def tps(d):
        """Tokens/s of a successful run, else None."""
        return d.get("tokens_per_sec") if d and not d.get("failed") else None

    def best_and_range(self, row):
        """The fastest successful run of a row (other load only slows a run down) and (min, max) tokens/s."""
        ok = [d for d in self.runs.get(row, []) if self.tps(d)]
        if not ok:
            return None, None
        return max(ok, key=self.tps), (min(map(self.tps, ok)), max(map(self.tps, ok)))

    def best(self, row):
        return self.best_and_range(row)[0]
