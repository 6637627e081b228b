# A clock64 phase profile of paged_attention_prefill's sm90 kernel for this harness: writes an
# instrumented copy of prefill_sm90_ws.cu whose launches print, on the third launch of each shape
# (batch, longest query, page size, group, fp8 cache, grid), cycles a work tile per phase:
#   consumer warpgroup: Q wait, its first turn, K(0) wait, S(0), the softmax of tile 0, each later
#     step (turn, V wait, retiring P V, K wait, S + softmax), the last P V, the epilogue (staging
#     into the Q buffer, reading it back with the proxy fence and the buffer's release, the
#     global stores; where TMA stores the tile, all of it counts as staging);
#   producer (thread 0): the list index, the tile's metadata, the Q buffer wait, the K / V slot
#     waits and copies.
# Sums of clock64 differences of one thread per warpgroup, added with global atomics: timing only
# (the profiled kernel runs 5-25% slower). The copy is made by exact text patches of the kernel,
# each asserted to match once: a kernel edit that moves one fails here, naming it.
#   python benchmarks/prefill_ab/mkprof.py csrc/kernels/attention/prefill_sm90_ws.cu /tmp/prof.cu
#   bash benchmarks/prefill_ab/build.sh main:csrc/kernels/attention/prefill_sm90_ws.cu \
#     prof:/tmp/prof.cu        # then build/ab on the GPU prints PROF lines beside the timings
import sys
src = open(sys.argv[1]).read()
def rep(old, new, count=1):
    global src
    n = src.count(old)
    assert n == count, (old, n)
    src = src.replace(old, new)

rep('namespace qwen3_kernels {\nnamespace prefill {\nnamespace {\n',
    'namespace qwen3_kernels {\nnamespace prefill {\n__device__ unsigned long long g_prof[64];\nnamespace {\n'
    '#define PROF_ADD(i, v) atomicAdd(&g_prof[i], (unsigned long long)(v))\n')
# producer
rep('    for (int k = 0;; ++k) {\n      WorkTile w;\n      bool more;\n',
    '    long long p_start = clock64();\n    for (int k = 0;; ++k) {\n      WorkTile w;\n      bool more;\n      long long pt0 = clock64();\n')
rep('        more = list_tile(i, m_blocks, p.num_kv_heads, batch, section_pairs, w);\n',
    '        if (tid == 0) PROF_ADD(21, clock64() - pt0);\n        more = list_tile(i, m_blocks, p.num_kv_heads, batch, section_pairs, w);\n')
rep('      const int b = j % kQBuffers;\n      mbar_wait<true>(bar_q_empty + 8 * b, ((j / kQBuffers) & 1) ^ 1);\n',
    '      long long pt1 = clock64();\n      if (tid == 0 && more) { PROF_ADD(20, 1); PROF_ADD(22, pt1 - pt0); }\n'
    '      const int b = j % kQBuffers;\n      mbar_wait<true>(bar_q_empty + 8 * b, ((j / kQBuffers) & 1) ^ 1);\n'
    '      if (tid == 0 && more) PROF_ADD(23, clock64() - pt1);\n')
rep('''        for (int kt = 0; kt < t.n_tiles; ++kt) {
          mbar_wait<true>(bar_k_empty + 8 * k_stage, k_parity ^ 1);
          load_tile(s_k + k_stage * kTileBytes, k_head, kt);
          cp_async_mbar_arrive(bar_k_full + 8 * k_stage);
          advance_k();
          mbar_wait<true>(bar_v_empty + 8 * v_stage, v_parity ^ 1);
          load_tile(s_v + v_stage * kTileBytes, v_head, kt);
''', '''        for (int kt = 0; kt < t.n_tiles; ++kt) {
          long long a0 = clock64();
          mbar_wait<true>(bar_k_empty + 8 * k_stage, k_parity ^ 1);
          long long a1 = clock64();
          load_tile(s_k + k_stage * kTileBytes, k_head, kt);
          long long a2 = clock64();
          cp_async_mbar_arrive(bar_k_full + 8 * k_stage);
          advance_k();
          mbar_wait<true>(bar_v_empty + 8 * v_stage, v_parity ^ 1);
          long long a3 = clock64();
          if (tid == 0) { PROF_ADD(kt == 0 ? 28 : 24, a1 - a0); PROF_ADD(26, a2 - a1); PROF_ADD(25, a3 - a2); PROF_ADD(29, 1); }
          load_tile(s_v + v_stage * kTileBytes, v_head, kt);
''')
rep('''    // Outstanding copies finish before the thread exits (their barrier arrivals still count).
''', '''    if (tid == 0) PROF_ADD(27, clock64() - p_start);
    // Outstanding copies finish before the thread exits (their barrier arrivals still count).
''')
# consumer
rep('''  for (int j = 0;; ++j) {
    // Every thread waits for the tile's Q and TileInfo itself.
    const int b = j % kQBuffers;
    const uint32_t q_buf = s_q + b * kQBytes;
    mbar_wait(bar_q_full + 8 * b, (j / kQBuffers) & 1);
''', '''  const bool prof = (tid & 127) == 0;
  long long c_start = clock64();
  for (int j = 0;; ++j) {
    // Every thread waits for the tile's Q and TileInfo itself.
    const int b = j % kQBuffers;
    const uint32_t q_buf = s_q + b * kQBytes;
    long long ct0 = clock64();
    mbar_wait(bar_q_full + 8 * b, (j / kQBuffers) & 1);
    if (prof) PROF_ADD(1, clock64() - ct0);
''')
rep('''    if (n_tiles > 0) {
      named_bar_sync(my_turn, 256);
      mbar_wait(bar_k_full + 8 * k_stage, k_parity);
      fence_proxy_async();
      float s[64];
      wgmma_fence();
      issue_s(s, q_buf, s_k + k_stage * kTileBytes);
      wgmma_commit();
      named_bar_arrive(other_turn, 256);
      release_previous(j);
      wgmma_wait<0>();
      fence_regs(s);
      if (lane == 0) mbar_arrive(bar_k_empty + 8 * k_stage);  // this warp is done with K(0)
      softmax(s, 0, alpha);
      pack_p(s, p_buf[0]);
      advance_k();
    }''', '''    if (n_tiles > 0) {
      long long b0 = clock64();
      named_bar_sync(my_turn, 256);
      long long b1 = clock64();
      mbar_wait(bar_k_full + 8 * k_stage, k_parity);
      long long b2 = clock64();
      fence_proxy_async();
      float s[64];
      wgmma_fence();
      issue_s(s, q_buf, s_k + k_stage * kTileBytes);
      wgmma_commit();
      named_bar_arrive(other_turn, 256);
      release_previous(j);
      wgmma_wait<0>();
      fence_regs(s);
      long long b3 = clock64();
      if (lane == 0) mbar_arrive(bar_k_empty + 8 * k_stage);  // this warp is done with K(0)
      softmax(s, 0, alpha);
      pack_p(s, p_buf[0]);
      fence_regs(s);
      long long b4 = clock64();
      if (prof) { PROF_ADD(0, 1); PROF_ADD(2, b1 - b0); PROF_ADD(3, b2 - b1); PROF_ADD(4, b3 - b2); PROF_ADD(5, b4 - b3); }
      advance_k();
    }''')
rep('''      named_bar_sync(my_turn, 256);
      mbar_wait(bar_v_full + 8 * v_stage, v_parity);  // issued before K(n): usually landed
      retire_pv();
      mbar_wait(bar_k_full + 8 * k_stage, k_parity);
      fence_proxy_async();
''', '''      long long e0 = clock64();
      named_bar_sync(my_turn, 256);
      long long e1 = clock64();
      mbar_wait(bar_v_full + 8 * v_stage, v_parity);  // issued before K(n): usually landed
      long long e2 = clock64();
      retire_pv();
      long long e3 = clock64();
      mbar_wait(bar_k_full + 8 * k_stage, k_parity);
      long long e4 = clock64();
      if (prof) { PROF_ADD(6, 1); PROF_ADD(7, e1 - e0); PROF_ADD(8, e2 - e1); PROF_ADD(9, e3 - e2); PROF_ADD(10, e4 - e3); }
      fence_proxy_async();
''')
rep('''      pack_p(s, p_next);  // into the buffer P V is not reading
      pp_stage = v_stage;
''', '''      pack_p(s, p_next);  // into the buffer P V is not reading
      fence_regs(s);
      if (prof) PROF_ADD(11, clock64() - e4);
      pp_stage = v_stage;
''')
rep('''    auto last_pv = [&](uint32_t (&p_last)[kBlockN / 16][4]) {
      mbar_wait(bar_v_full + 8 * v_stage, v_parity);
      retire_pv();
''', '''    auto last_pv = [&](uint32_t (&p_last)[kBlockN / 16][4]) {
      long long l0 = clock64();
      mbar_wait(bar_v_full + 8 * v_stage, v_parity);
      long long l1 = clock64();
      if (prof) PROF_ADD(13, l1 - l0);
      retire_pv();
''')
rep('''      if (lane == 0) mbar_arrive(bar_v_empty + 8 * v_stage);
      advance_v();
    };
''', '''      if (lane == 0) mbar_arrive(bar_v_empty + 8 * v_stage);
      if (prof) PROF_ADD(14, clock64() - l1);
      advance_v();
    };
''')
rep('''    float inv[2];
    inverse_row_sums(row_sum, inv);
''', '''    long long ep0 = clock64();
    float inv[2];
    inverse_row_sums(row_sum, inv);
''')
rep('''        ++token;
      }
    }
  }
''', '''        ++token;
      }
    }
    long long q3 = clock64();
    if (prof) {
      PROF_ADD(15, q3 - ep0);
      PROF_ADD(17, q3 - ct0);
      PROF_ADD(19, q3 - q2);
    }
  }
  if (prof) PROF_ADD(16, clock64() - c_start);
''')
# host side: reset before, print after (third launch of each shape)
rep('''  kernel<<<grid, kThreads, kSmemBytes, stream>>>(lp, q_map, (int)m_blocks, batch, section_pairs,
                                                 out_map);
  return cudaGetLastError();
''', '''  static std::map<std::string, int> seen;
  char keybuf[128];
  snprintf(keybuf, sizeof keybuf, "b%d mq%d log2bs%d grp%d fp8%d pers%d", batch, max_seqlen_q,
           p.block_size_log2, p.group, (int)std::is_same_v<KV, uint8_t>, (int)kPersistent);
  const int n_seen = ++seen[keybuf];
  void* prof_ptr = nullptr;
  cudaGetSymbolAddress(&prof_ptr, g_prof);
  if (n_seen == 3) cudaMemsetAsync(prof_ptr, 0, sizeof(unsigned long long) * 64, stream);
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(lp, q_map, (int)m_blocks, batch, section_pairs,
                                                 out_map);
  if (n_seen == 3) {
    unsigned long long h[64];
    cudaStreamSynchronize(stream);
    cudaMemcpy(h, prof_ptr, sizeof h, cudaMemcpyDeviceToHost);
    const double ct = h[0] ? (double)h[0] : 1, st = h[6] ? (double)h[6] : 1;
    const double pt = h[20] ? (double)h[20] : 1, kt = h[29] ? (double)h[29] : 1;
    printf("PROF %s grid %u: consumer wg-tiles %llu steps/tile %.2f | per tile: total %.0f waitQ %.0f "
           "turn0 %.0f waitK0 %.0f S0 %.0f sm0 %.0f | steps (per step): turn %.0f waitV %.0f retire %.0f waitK %.0f "
           "issue+S+sm %.0f | last: waitV %.0f pv %.0f | epi %.0f (stage %.0f stores %.0f read+fence+release %.0f) | wg-life %.0f per tile\\n",
           keybuf, grid.x, h[0], h[6] / ct, h[17] / ct, h[1] / ct, h[2] / ct, h[3] / ct, h[4] / ct,
           h[5] / ct, h[7] / st, h[8] / st, h[9] / st, h[10] / st, h[11] / st, h[13] / ct,
           h[14] / ct, h[15] / ct, h[18] / ct, h[19] / ct, h[30] / ct, h[16] / ct);
    printf("PROF %s producer tiles %llu kv-tiles/tile %.2f | per tile: idx %.0f meta %.0f qwait %.0f "
           "k0wait %.0f | per kv tile: kwait(>0) %.0f load %.0f vwait %.0f | life %.0f per tile\\n",
           keybuf, h[20], h[29] / pt, h[21] / pt, h[22] / pt, h[23] / pt, h[28] / pt, h[24] / kt,
           h[26] / kt, h[25] / kt, h[27] / pt);
  }
  return cudaGetLastError();
''')
rep('#include <mutex>\n', '#include <mutex>\n#include <map>\n#include <string>\n#include <cstdio>\n')

# the epilogue in three parts: staging into the Q buffer, reading it back + the proxy fence +
# the release, the global stores
rep('''    const int chunk = lane & 15;
    uint4 staged[8];''', '''    long long q0 = clock64();
    const int chunk = lane & 15;
    uint4 staged[8];''')
rep('''    if (!kTmaOut && lane == 0) mbar_arrive(bar_q_empty + 8 * b);
    // Packed row pr''', '''    if (lane == 0) mbar_arrive(bar_q_empty + 8 * b);
    long long q2 = clock64();
    if (prof) { PROF_ADD(18, q0 - ep0); PROF_ADD(30, q2 - q0); }
    // Packed row pr''')
# kTmaOut's stores (lane 0 issues them; the buffer goes back at the next tile): the whole epilogue
# counted as staging
rep('''          bulk_commit_group();
        }
        continue;''', '''          bulk_commit_group();
        }
        const long long qt = clock64();
        if (prof) { PROF_ADD(15, qt - ep0); PROF_ADD(17, qt - ct0); PROF_ADD(18, qt - ep0); }
        continue;''')
open(sys.argv[2], 'w').write(src)
