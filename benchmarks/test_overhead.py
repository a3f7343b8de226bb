"""Overhead of rlprof's annotations against the least a hand-written wrapper could do.

- off: a ``@profiled`` call with no tool (or role/step not selected) vs a minimal pass-through wrapper.
  Target <= 1.2x.
- nsys on: a ``@profiled`` call inside a selected step with the nsys tool vs the same wrapper around the fastest
  documented use of nvtx: a ``Domain`` with pre-built event attributes (``domain.push_range(attributes)``). Target
  <= 1.15x. Also reported: against nvtx's module API (``nvtx.push_range``/``pop_range`` with message, colour, domain
  and category per call) and against the lowest level there is (``nvtx._lib.lib.push_range(attributes, handle)``,
  the C calls rlprof itself binds per site).

Each target is asserted on the best of up to three measurements (a noisy machine retries; the bound stays).

The ratio is stored in the benchmark's ``extra_info`` and printed; run ``pytest benchmarks -s`` to see it.
"""

from __future__ import annotations

import functools

import nvtx

import rlprof
from rlprof.tools.nsys import DOMAIN, open_domain, role_color

from conftest import ratio

OFF_TARGET = 1.2
NSYS_TARGET = 1.15
ATTEMPTS = 3


def work(x):
    return x


def pass_through(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


def raw_nvtx(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nvtx.push_range(message="work", color=role_color("actor"), domain=DOMAIN, category="actor")
        try:
            return fn(*args, **kwargs)
        finally:
            nvtx.pop_range(domain=DOMAIN)

    return wrapper


def raw_lib(fn, push, pop):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        push()
        try:
            return fn(*args, **kwargs)
        finally:
            pop()

    return wrapper


def raw_domain_prebuilt(fn, domain, attributes):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        domain.push_range(attributes)
        try:
            return fn(*args, **kwargs)
        finally:
            domain.pop_range()

    return wrapper


def compare(benchmark, name, subject, baseline, target=None):
    """Measure the ratio (up to ATTEMPTS times while it misses ``target``) and record the best one."""
    best = None
    for _ in range(ATTEMPTS if target else 1):
        s, b, r = ratio(lambda: subject(1), lambda: baseline(1))
        if best is None or r < best[2]:
            best = (s, b, r)
        if target is None or r <= target:
            break
    s, b, r = best
    benchmark.extra_info.update({f"{name}_ns": s * 1e9, f"{name}_baseline_ns": b * 1e9, f"{name}_ratio": r})
    goal = f"target <= {target}" if target else "information"
    print(f"\n{name}: {s * 1e9:.1f} ns/call vs baseline {b * 1e9:.1f} ns/call -> ratio {r:.3f} ({goal})")
    return r


def report(benchmark, speed_target, name, subject, baseline, target):
    r = compare(benchmark, name, subject, baseline, target)
    benchmark(subject, 1)
    speed_target(r <= target, f"{name}: {r:.2f}x the baseline (target <= {target}x)")


def test_profiled_call_with_profiling_off(benchmark, speed_target):
    rlprof.init({"global_profiler": {"tool": None}})
    profiled = rlprof.profiled(role="actor")(work)
    report(benchmark, speed_target, "profiled_off", profiled, pass_through(work), OFF_TARGET)


def test_profiled_call_with_step_not_selected(benchmark, speed_target):
    rlprof.init({"global_profiler": {"tool": "nsys", "steps": [5], "save_path": "outputs/bench"}})
    rlprof.step(1)
    profiled = rlprof.profiled(role="actor")(work)
    report(benchmark, speed_target, "profiled_unselected_step", profiled, pass_through(work), OFF_TARGET)


def test_profiled_call_with_nsys_on(benchmark, speed_target):
    from nvtx._lib import lib

    rlprof.init({"global_profiler": {"tool": "nsys", "steps": [1], "save_path": "outputs/bench"}})
    rlprof.step(1)
    profiled = rlprof.profiled(role="actor", name="work")(work)
    domain = open_domain(DOMAIN)
    attributes = domain.get_event_attributes(message="work", color=role_color("actor"), category="actor")
    compare(benchmark, "vs_nvtx_module_api", profiled, raw_nvtx(work))
    compare(
        benchmark,
        "vs_lowest_level_c_calls",
        profiled,
        raw_lib(
            work,
            functools.partial(lib.push_range, attributes, domain.handle),
            functools.partial(lib.pop_range, domain.handle),
        ),
    )
    prebuilt = raw_domain_prebuilt(work, domain, attributes)
    report(benchmark, speed_target, "profiled_nsys_on", profiled, prebuilt, NSYS_TARGET)
