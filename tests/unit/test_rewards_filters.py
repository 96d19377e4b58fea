"""Reward functions, dynamic filters and drop accounting (pure, no sockets)."""

from __future__ import annotations

import asyncio
import itertools
import json
import textwrap
import threading

import pytest

from common.errors import ConfigError, RolloutError
from common.filters import DropStats, FilterError, Verdict, load_filter
from common.rewards import RewardError, load_reward, per_group
from common.types import Sample


def sample(text: str = "", label=None, reward: float = 0.0, status: str = "completed", **md) -> Sample:
    return Sample(
        prompt_tokens=[1, 2],
        response_tokens=[3],
        response_logprobs=[-0.1],
        loss_mask=[1],
        reward=reward,
        status=status,
        weight_version="v0",
        label=label,
        metadata=md,
        response_text=text,
    )


def score(spec: str, samples: list[Sample]) -> list[float]:
    return asyncio.run(load_reward(spec).score(samples))


def check(spec: str, rewards: list[float]) -> Verdict:
    return asyncio.run(load_filter(spec).check([sample(reward=r) for r in rewards]))


_MODULE_IDS = itertools.count()


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write a module into tmp_path, importable by name; returns its name."""

    def write(source: str) -> str:
        # Unique across the session: sys.modules caches imports by name.
        name = f"user_mod_{next(_MODULE_IDS)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    monkeypatch.syspath_prepend(str(tmp_path))
    return write


# ---------------------------------------------------------------- math


@pytest.mark.parametrize(
    "text, label",
    [
        ("The answer is \\boxed{42}.", 42),
        ("first \\boxed{7}, on reflection \\boxed{12}", "12"),
        ("so $\\boxed{\\frac{3}{4}}$", "3/4"),  # nested braces
        ("\\boxed{\\frac{3}{4}}", 0.75),
        ("We get 3/4 of the cake", "\\frac{3}{4}"),
        ("Step 1: 10 apples. Total: 1,234", 1234),
        ("Total: 1234 apples", "1,234"),
        ("the result is 1,234.5.", 1234.5),
        ("the temperature drops to -5 degrees", -5),
        ("\\boxed{-\\frac{1}{2}}", "-0.5"),
        ("x = 2.50", "2.5"),
        ("\\boxed{0.3333333}", "1/3"),  # within 1e-6 relative
        ("\\boxed{x + 1}", "x+1"),  # non-numeric both sides: normalised string compare
        ("\\boxed{12} but then I wrote \\boxed{1", "12"),  # unclosed (truncated) box ignored
    ],
)
def test_math_reward_accepts_correct_answers(text, label):
    assert score("math", [sample(text, label)]) == [1.0]


@pytest.mark.parametrize(
    "text, label",
    [
        ("\\boxed{41}", 42),
        ("I think 7 then 8", 7),  # the *last* number counts
        ("5-3", -3),  # a binary minus is not a sign
        ("\\boxed{0.3334}", "1/3"),
        ("no answer here", 5),
        ("\\boxed{5}", None),  # no label: nothing can be right
        ("\\boxed{x+2}", "x+1"),
    ],
)
def test_math_reward_rejects_wrong_answers(text, label):
    assert score("math", [sample(text, label)]) == [0.0]


def test_math_reward_scores_truncated_samples_like_any_other():
    got = score("math", [sample("\\boxed{3}", 3, status="truncated"), sample("\\boxed{4}", 3, status="truncated")])
    assert got == [1.0, 0.0]


def test_exact_reward():
    samples = [
        sample("  42 \n", 42),
        sample("so the answer is \\boxed{ 42 }", "42"),
        sample("42.0", 42),
        sample("Paris", "paris"),
        sample("anything", None),
    ]
    assert score("exact", samples) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_builtins_run_inline_on_the_loop():
    # Built-ins are on the hot path: no thread hop.
    seen = []

    async def main():
        fn = load_reward("math")
        fn.fn = lambda s: seen.append(threading.get_ident()) or 1.0
        await fn.score([sample("1", 1)])

    asyncio.run(main())
    assert seen == [threading.main_thread().ident]


# ---------------------------------------------------------------- custom rewards


def test_custom_sync_reward_runs_in_a_thread_and_sees_prompt_metadata(user_module):
    mod = user_module(
        """
        import threading
        THREADS = set()
        def length_bonus(sample):
            THREADS.add(threading.get_ident())
            return len(sample.response_text) + (0.5 if sample.metadata.get("prompt") == "hi" else 0)
        """
    )
    got = score(f"{mod}:length_bonus", [sample("ab", prompt="hi"), sample("abcd")])
    assert got == [2.5, 4.0]
    import importlib

    threads = importlib.import_module(mod).THREADS
    assert threading.main_thread().ident not in threads


def test_custom_async_reward(user_module):
    mod = user_module(
        """
        import asyncio
        async def judge(sample):
            await asyncio.sleep(0)
            return 1 if sample.label == sample.response_text else 0
        """
    )
    assert score(f"{mod}:judge", [sample("a", "a"), sample("b", "a")]) == [1.0, 0.0]


def test_sync_reward_returning_an_awaitable_is_awaited(user_module):
    mod = user_module(
        """
        async def _later(v):
            return v
        def deferred(sample):
            return _later(0.25)
        """
    )
    assert score(f"{mod}:deferred", [sample("x")]) == [0.25]


def test_per_group_reward_sync_and_async(user_module):
    mod = user_module(
        """
        from common.rewards import per_group
        @per_group
        def rank(samples):
            order = sorted(range(len(samples)), key=lambda i: len(samples[i].response_text))
            out = [0.0] * len(samples)
            for r, i in enumerate(order):
                out[i] = float(r)
            return out
        @per_group
        async def arank(samples):
            return tuple(rank(samples))
        """
    )
    samples = [sample("ccc"), sample("a"), sample("bb")]
    assert score(f"{mod}:rank", samples) == [2.0, 0.0, 1.0]
    assert score(f"{mod}:arank", samples) == [2.0, 0.0, 1.0]
    assert load_reward(f"{mod}:rank").per_group


def test_per_group_decorator_marks_function():
    @per_group
    def f(samples):
        return []

    assert f.rollfleet_per_group is True


@pytest.mark.parametrize(
    "body, problem",
    [
        ("def f(s): return float('nan')", "nan"),
        ("def f(s): return float('inf')", "inf"),
        ("def f(s): return True", "bool"),
        ("def f(s): return '1.0'", "str"),
        ("def f(s): return None", "NoneType"),
        ("def f(s): raise KeyError('boom')", "KeyError"),
        ("from common.rewards import per_group\n@per_group\ndef f(ss): return [1.0]", "1 values for 2 samples"),
        ("from common.rewards import per_group\n@per_group\ndef f(ss): return 1.0", "expected a list"),
    ],
)
def test_bad_reward_values_raise_reward_error_naming_the_function(user_module, body, problem):
    mod = user_module(body)
    with pytest.raises(RewardError) as info:
        score(f"{mod}:f", [sample("a"), sample("b")])
    assert f"{mod}:f" in str(info.value)
    assert problem in str(info.value)
    assert isinstance(info.value, RolloutError)


def test_bad_reward_specs_name_the_spec(user_module):
    mod = user_module("X = 3\ndef ok(s): return 1.0\n")
    broken = user_module("raise RuntimeError('import-time failure')\n")
    cases = {
        "no_such_module_xyz:f": "cannot import module",
        f"{mod}:missing": "no attribute 'missing'",
        f"{mod}:X": "not callable",
        f"{broken}:f": "import-time failure",
        "mathh": "unknown reward",
        f"{mod}:": "expected 'module:function'",
    }
    for spec, problem in cases.items():
        with pytest.raises(ConfigError) as info:
            load_reward(spec)
        assert repr(spec) in str(info.value), spec
        assert problem in str(info.value), spec


def test_score_does_not_set_rewards():
    s = sample("\\boxed{1}", 1, reward=-7.0)
    assert score("math", [s]) == [1.0]
    assert s.reward == -7.0


# ---------------------------------------------------------------- filters


def test_nonzero_std_keeps_varied_groups_and_names_the_shared_reward():
    assert check("nonzero_std", [0.0, 1.0, 1.0]) == Verdict(True, "")
    assert check("nonzero_std", [1.0, 1.0]) == Verdict(False, "zero_std_1")
    assert check("nonzero_std", [0.0, 0.0, 0.0]) == Verdict(False, "zero_std_0")
    assert check("nonzero_std", [-0.0, 0.0]) == Verdict(False, "zero_std_0")
    assert check("check_reward_nonzero_std", [0.5, 0.5]) == Verdict(False, "zero_std_0.5")
    assert check("nonzero_std", [-1.0, -1.0]).reason == "zero_std_-1"


def test_none_filter_keeps_everything():
    assert check("none", [1.0, 1.0]).keep
    assert check("none", [0.0]).keep


@pytest.mark.parametrize(
    "ret, verdict",
    [
        ("True", Verdict(True, "")),
        ("False", Verdict(False, "dynamic_filter")),
        ("(False, 'too long')", Verdict(False, "too_long")),
        ("(False, '')", Verdict(False, "dynamic_filter")),
        ("(False, None)", Verdict(False, "dynamic_filter")),
        ("(True, 'fine')", Verdict(True, "fine")),
        ("Verdict(False, 'len>4096/é')", Verdict(False, "len_4096__")),
        ("Verdict(False)", Verdict(False, "dynamic_filter")),
    ],
)
def test_custom_filter_verdicts_are_normalised(user_module, ret, verdict):
    mod = user_module(f"from common.filters import Verdict\ndef f(samples): return {ret}\n")
    amod = user_module(f"from common.filters import Verdict\nasync def f(samples): return {ret}\n")
    assert check(f"{mod}:f", [1.0, 0.0]) == verdict
    assert check(f"{amod}:f", [1.0, 0.0]) == verdict


def test_custom_filter_sees_rewards(user_module):
    mod = user_module("def f(samples): return (max(s.reward for s in samples) > 0.5, 'all_low')\n")
    assert check(f"{mod}:f", [0.1, 0.9]).keep
    assert check(f"{mod}:f", [0.1, 0.2]) == Verdict(False, "all_low")


def test_bad_filter_results_and_specs(user_module):
    mod = user_module("def f(samples): return 'yes'\ndef g(samples): raise ValueError('x')\nY = 1\n")
    with pytest.raises(FilterError, match=f"{mod}:f"):
        check(f"{mod}:f", [1.0])
    with pytest.raises(FilterError, match="ValueError"):
        check(f"{mod}:g", [1.0])
    for spec, problem in [
        (f"{mod}:Y", "not callable"),
        ("nope_mod_zz:f", "cannot import"),
        ("bogus", "unknown filter"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_filter(spec)
        assert repr(spec) in str(info.value) and problem in str(info.value)


# ---------------------------------------------------------------- DropStats


def test_drop_stats_metrics_merge_and_round_trip():
    a = DropStats()
    for v in [Verdict(True), Verdict(False, "zero_std_1"), Verdict(False, "zero_std_1"), Verdict(False, "zero_std_0")]:
        a.record(v)
    m = a.metrics()
    assert m == {
        "rollout/dynamic_filter/drop_zero_std_0": 1,
        "rollout/dynamic_filter/drop_zero_std_1": 2,
        "rollout/dynamic_filter/dropped_groups": 3,
        "rollout/dynamic_filter/kept_groups": 1,
        "rollout/dynamic_filter/dropped_ratio": 0.75,
    }
    assert a.metrics(prefix="x")["x/dropped_ratio"] == 0.75

    b = DropStats()
    b.record(Verdict(True))
    b.record_dropped("bad reason!")
    a.merge(b)
    assert a.kept == 2 and a.dropped["bad_reason_"] == 1

    wire = json.loads(json.dumps(a.to_dict()))  # plain JSON types only
    assert DropStats.from_dict(wire) == a
    assert DropStats.from_dict(wire).metrics() == a.metrics()


def test_empty_drop_stats_ratio_is_zero():
    assert DropStats().metrics() == {
        "rollout/dynamic_filter/dropped_groups": 0,
        "rollout/dynamic_filter/kept_groups": 0,
        "rollout/dynamic_filter/dropped_ratio": 0.0,
    }
