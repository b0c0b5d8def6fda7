#!/usr/bin/python3
"""Tests of the performance model, bench/model/scale_model.py (issue 20):
hand-computed small cases for every method, ring all-reduce's
2 (P-1)/P n elements, the tbf bucket, monotonicity, the costs read from
bench/results and the validation against a lowbw result. Stdlib only;
seconds."""

import math
import os
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench", "model"))
import costs  # noqa: E402
import scale_model as sm  # noqa: E402


def zero_costs(**over):
    """Every CPU cost 0, 8-byte pairs: only bytes / bandwidth remain."""
    c = {"pair_bytes": 8.0, "encode_per_pair": 0.0, "decode_per_pair": 0.0,
         "merge_per_pair": lambda P: 0.0, "sparse_topk_per_entry": 0.0,
         "apply_per_pair": 0.0, "dense_add_per_element": 0.0,
         "dense_codec_per_element": 0.0, "message_overhead": 0.0,
         "message_cpu": 0.0, "threshold_exchange": lambda S: 0.0,
         "gpu_select": lambda n: 0.0, "cpu_select_per_element": 0.0,
         "latency": 0.0, "prediction_latency": 0.0, "link_check": {}}
    c.update(over)
    return c


LINK = sm.Link(1000.0)  # 1000 bytes/s each way: bytes read as milliseconds


class GridMergeTest(unittest.TestCase):
    """bench/lowbw/grid.py's merge: one machine entry per part (each part's
    command, commit and load), every part's runs with their rate."""

    def test_every_part_is_listed_once(self):
        import json
        import tempfile
        sys.path.insert(0, os.path.join(ROOT, "bench", "lowbw"))
        import grid  # noqa: E402
        tmp = tempfile.mkdtemp(prefix="gtopk_grid_")
        parts = os.path.join(tmp, "lowbw_grid")
        os.makedirs(parts)

        def part(name, rate, shards, load, runs):
            with open(os.path.join(parts, name + ".json"), "w") as f:
                json.dump({"command": "lowbw.py " + name, "git_commit": name,
                           "date_utc": "d", "wall_seconds": 1.0,
                           "machine": {"load_before": load},
                           "config": {"rate_per_link_each_direction": rate,
                                      "shards": shards, "workers": [2],
                                      "methods": ["gtopk"], "n": 10,
                                      "density": 0.1},
                           "baseline_single_worker_seconds": {},
                           "runs": runs}, f)

        run = {"method": "gtopk", "workers": 2, "shards": 1,
               "step_seconds_p50": 0.2, "compute_seconds_p50": 0.1,
               "local_seconds_p50": 0.05, "communication_seconds_p50": 0.05,
               "load_average_1m_before": 1.0,
               "sent_bytes_per_worker_per_step": 1,
               "received_bytes_per_worker_per_step": 1}
        part("1gbit-s1", "1gbit", 1, "1.0", [dict(run)])
        part("1gbit-s2", "1gbit", 2, "2.0", [dict(run, shards=2)])
        part("10gbit-s1", "10gbit", 1, "3.0", [dict(run)])
        old = (grid.PARTS, grid.ROOT)
        grid.PARTS, grid.ROOT = parts, tmp
        try:
            doc = grid.merge(os.path.join(tmp, "lowbw.json"), "test")
        finally:
            grid.PARTS, grid.ROOT = old
        self.assertEqual(sorted(doc["parts"]), sorted(
            os.path.join("lowbw_grid", n + ".json")
            for n in ("1gbit-s1", "1gbit-s2", "10gbit-s1")))
        self.assertEqual(sorted(m["load_before"] for m in doc["machine"]),
                         ["1.0", "2.0", "3.0"])
        self.assertEqual(doc["config"]["shards"], [1, 2])
        self.assertEqual(sorted(r["rate"] for r in doc["runs"]),
                         ["10gbit", "1gbit", "1gbit"])


class RingTest(unittest.TestCase):
    def test_bytes_are_two_p_minus_one_over_p_n(self):
        for P in (2, 3, 4, 8, 64):
            r = sm.ring(1000, P, 0, LINK, zero_costs())
            self.assertAlmostEqual(r["sent"], 2 * (P - 1) / P * 4 * 1000)
            self.assertAlmostEqual(r["received"], r["sent"])

    def test_hand_case(self):
        # n = 1000 floats, P = 4: 2 * 3/4 * 4000 B = 6000 B at 1000 B/s =
        # 6 s, plus 2 (P-1) = 6 messages of 0.1 s latency + 0.05 s overhead.
        r = sm.ring(1000, 4, 0, sm.Link(1000.0, latency=0.1),
                    zero_costs(message_overhead=0.05))
        self.assertAlmostEqual(r["comm"], 6.0 + 6 * 0.15)

    def test_one_worker_has_nothing_to_exchange(self):
        self.assertEqual(sm.ring(1000, 1, 0, LINK, zero_costs())["comm"], 0.0)


class ShardedTest(unittest.TestCase):
    def test_gtopk_hand_case(self):
        # n = 10,000, density 0.01: k = 100 pairs of 8 B. P = 4, S = 2:
        # a worker sends 800 B (0.8 s); a shard receives 4 x 50 x 8 =
        # 1600 B (1.6 s): the push takes 1.6 s, the pull the same; two
        # messages of 0.05 s latency + 0.1 s overhead: 3.2 + 0.3.
        c = zero_costs(message_overhead=0.1)
        r = sm.gtopk_ps(10000, 4, 2, sm.Link(1000.0, latency=0.05), c, 0.01)
        self.assertAlmostEqual(r["push"], 1.6)
        self.assertAlmostEqual(r["pull"], 1.6)
        self.assertAlmostEqual(r["comm"], 3.5)
        self.assertAlmostEqual(r["sent"], 800)
        self.assertAlmostEqual(r["received"], 800)

    def test_gtopk_worker_bound_when_shards_match_workers(self):
        # S = P: a shard's NIC carries what a worker's does: 0.8 s each way.
        r = sm.gtopk_ps(10000, 4, 4, LINK, zero_costs(), 0.01)
        self.assertAlmostEqual(r["comm"], 1.6)

    def test_gtopk_threshold_exchange_only_with_shards(self):
        c = zero_costs(threshold_exchange=lambda S: 0.5 if S > 1 else 0.0)
        one = sm.gtopk_ps(10000, 4, 1, LINK, c, 0.01)["comm"]
        two = sm.gtopk_ps(10000, 4, 2, LINK, c, 0.01)["comm"]
        self.assertAlmostEqual(one, 2 * 3.2)  # 4 x 100 x 8 B each way
        self.assertAlmostEqual(two, 3.2 + 0.5)

    def test_topk_hand_case(self):
        # The union of P = 4 random 1 % subsets of a shard's 5000:
        # 0.99^4 = 0.96059601, 5000 x 0.03940399 = 197.01995 pairs; each of
        # 4 workers pulls it from each of 2 shards: shard NIC
        # 4 x 197.02 x 8 B = 6.305 s.
        r = sm.topk_ps(10000, 4, 2, LINK, zero_costs(), 0.01)
        u = 5000 * (1 - 0.99 ** 4)
        self.assertAlmostEqual(u, 197.01995, places=6)
        self.assertAlmostEqual(r["pull"], 4 * u * 8 / 1000)
        self.assertAlmostEqual(r["comm"], 1.6 + 4 * u * 8 / 1000)
        self.assertAlmostEqual(r["received"], 2 * u * 8)

    def test_dense_hand_case(self):
        # n = 1000: a worker's 4000 B (4 s); a shard's 4 x 2000 B (8 s),
        # both ways.
        r = sm.dense_ps(1000, 4, 2, LINK, zero_costs())
        self.assertAlmostEqual(r["comm"], 16.0)


class PaperMethodsTest(unittest.TestCase):
    def test_gtopk_tree_hand_case(self):
        # k = 100 pairs of 8 B: 0.8 s per round; P = 8: 3 reduce + 3
        # broadcast rounds = 4.8 s (2 log2 P x 8k / B).
        r = sm.gtopk_tree(10000, 8, 0, LINK, zero_costs(), 0.01)
        self.assertAlmostEqual(r["comm"], 4.8)

    def test_topk_allgather_hand_case(self):
        # (P - 1) 8k B = 7 x 800 = 5600 B: 5.6 s.
        r = sm.topk_allgather(10000, 8, 0, LINK, zero_costs(), 0.01)
        self.assertAlmostEqual(r["comm"], 5.6)

    def test_orders_k_log_p_against_k_p(self):
        c = zero_costs()
        t = {P: sm.gtopk_tree(10000, P, 0, LINK, c, 0.01)["comm"] for P in (16, 256)}
        a = {P: sm.topk_allgather(10000, P, 0, LINK, c, 0.01)["comm"] for P in (16, 256)}
        self.assertAlmostEqual(t[256] / t[16], 8 / 4)
        self.assertAlmostEqual(a[256] / a[16], 255 / 15)


class LinkTest(unittest.TestCase):
    def test_tbf_bucket(self):
        # 500 B of bucket at the line's 2000 B/s, the other 1000 B at 1000.
        link = sm.Link(1000.0, bucket=500, line=2000.0)
        self.assertAlmostEqual(link.time(1500), 0.25 + 1.0)
        self.assertAlmostEqual(link.time(400), 0.2)
        self.assertEqual(link.time(0), 0.0)

    def test_bad_bandwidth(self):
        with self.assertRaises(ValueError):
            sm.Link(0)


class RealCostsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.c = costs.load_costs()

    def test_merge_fit_reproduces_the_measurements(self):
        import json
        with open(os.path.join(ROOT, "bench", "results", "merge.json")) as f:
            merge = json.load(f)
        for r in merge["sum"]:
            measured = r["sparse_sum_us"] * 1e-6 / r["pairs"]
            self.assertLess(abs(self.c["merge_per_pair"](r["P"]) / measured - 1), 0.15)

    def test_more_bandwidth_never_slower(self):
        for m in sm.METHODS:
            for P in (4, 32, 256):
                t = [sm.step(m, 25557032, P, 4, rate, self.c, 0.1)["comm"]
                     for rate in (1, 10, 25, 100)]
                for slow, fast in zip(t, t[1:]):
                    self.assertLessEqual(fast, slow, (m, P))

    def test_more_workers_never_faster_for_ring(self):
        t = [sm.step("ring", 25557032, P, 1, 1, self.c, 0.1)["comm"]
             for P in sm.PS]
        self.assertEqual(t, sorted(t))

    def test_sparse_beats_dense_at_one_gbit(self):
        e = {m: sm.step(m, 25557032, 32, 8, 1, self.c, 0.1)["efficiency"]
             for m in sm.METHODS}
        self.assertGreater(e["gtopk_tree"], e["ring"])
        self.assertGreater(e["gtopk_tree"], e["topk_allgather"])
        self.assertGreater(e["gtopk_ps"], e["dense_ps"])

    def test_best_shards_is_a_power_of_two_up_to_p(self):
        for P in (8, 64):
            S, times = sm.best_shards(25557032, P, 1, self.c)
            self.assertIn(S, times)
            self.assertLessEqual(times[S], 1.1 * min(times.values()))
            self.assertTrue(all(times[s] > 1.1 * min(times.values())
                                for s in times if s < S))


class ShardCpuFitTest(unittest.TestCase):
    def test_per_message_cpu_from_measured_shard_cpu(self):
        # Shard CPU per step 10 ms at P = 2, 14 ms at P = 4: 2 ms per
        # worker; with merge and decode free that is a push and a pull:
        # 1 ms per message.
        import json
        import tempfile
        d = tempfile.mkdtemp()
        run = lambda P, t: {"method": "gtopk", "workers": P, "shards": 1,
                            "shard_cpu_seconds_per_timed_step": [t]}
        with open(os.path.join(d, "lowbw.json"), "w") as f:
            json.dump({"config": {"n": 1000000, "density": 0.001},
                       "runs": [run(2, 0.010), run(4, 0.014),
                                dict(run(4, 9.0), method="topk")]}, f)
        old = costs.RESULTS
        costs.RESULTS = d
        try:
            m, fits = costs.shard_cpu_per_worker(zero_costs())
        finally:
            costs.RESULTS = old
        self.assertAlmostEqual(m, 0.001)
        self.assertAlmostEqual(fits["1"]["slope_seconds_per_worker"], 0.002)


class ValidationTest(unittest.TestCase):
    def test_error_per_run(self):
        c = zero_costs(link_check={"1gbit": 1.0, "unlimited": 2.0})
        # One gtopk run, S = 1, P = 2, n = 1e7, density 0.001: 10,000 pairs
        # of 8 B from each worker; the shard's link carries 160,000 B each
        # way, inside tbf's 1 MB bucket, so at the veth's 2 Gbit/s
        # (250 MB/s): 0.64 ms each way, 1.28 ms; measured 2.56 ms: -50 %.
        lowbw = {"config": {"n": 10000000, "density": 0.001,
                            "rate_per_link_each_direction": "1gbit"},
                 "runs": [{"method": "gtopk", "workers": 2, "shards": 1,
                           "rate": "1gbit",
                           "last_pusher_communication_seconds_p50": 0.00256,
                           "communication_seconds_p50": 0.003}]}
        rows = sm.validate(lowbw, c)
        self.assertEqual(len(rows), 1)
        self.assertAlmostEqual(rows[0]["predicted_communication_seconds"],
                               0.00128, places=6)
        self.assertAlmostEqual(rows[0]["error"], -0.5)
        self.assertFalse(rows[0]["within_25_percent"])


if __name__ == "__main__":
    unittest.main()
