"""Reads the dumps of bench/soak/live_alloc.c: each process's live heap KiB over time, in all
and by thread (threads that never held 4 KiB are left out), and with --sizes the sizes whose
live blocks changed from the dump a tenth into the run to the last.

    /usr/bin/python3 bench/soak/live_alloc_report.py DIR [--columns 12] [--sizes]
"""
import argparse
import collections
import pathlib


def read_dump(path):
    """({tid: (name, live bytes)}, {(tid, size): live blocks}) of one dump file."""
    threads, sizes = {}, {}
    for line in path.read_text().splitlines():
        kind, tid, *rest = line.split()
        if kind == "T":
            threads[tid] = (rest[0], int(rest[1]))
        elif kind == "S":
            sizes[(tid, int(rest[0]))] = int(rest[1])
    return threads, sizes


def dumps_by_process(directory):
    processes = collections.defaultdict(list)
    for path in sorted(pathlib.Path(directory).glob("*.*.txt")):
        processes[path.name.split(".")[0]].append(read_dump(path))
    return processes


def report(pid, dumps, columns, sizes):
    picks = sorted({round(i * (len(dumps) - 1) / max(1, columns - 1)) for i in range(columns)})
    print(f"process {pid}: {len(dumps)} dumps; live KiB at dumps {picks}")
    totals = [sum(b for _, b in dumps[i][0].values()) // 1024 for i in picks]
    print(f"  {'all threads':30s}", " ".join(map(str, totals)))
    for tid, (name, _) in dumps[-1][0].items():
        series = [dumps[i][0].get(tid, (name, 0))[1] // 1024 for i in picks]
        if max(series) >= 4:
            print(f"  {name + ' ' + tid:30s}", " ".join(map(str, series)))
    if sizes:
        first, last = dumps[len(dumps) // 10][1], dumps[-1][1]
        for key in sorted(set(first) | set(last)):
            before, after = first.get(key, 0), last.get(key, 0)
            if before != after:
                print(f"  size {key[1]:>9} thread {key[0]}: {before} -> {after} blocks")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--columns", type=int, default=12)
    parser.add_argument("--sizes", action="store_true")
    args = parser.parse_args()
    processes = dumps_by_process(args.directory)
    if not processes:
        raise SystemExit(f"live_alloc_report: no dumps (<pid>.<n>.txt) in {args.directory}")
    for pid, dumps in processes.items():
        report(pid, dumps, args.columns, args.sizes)


if __name__ == "__main__":
    main()
