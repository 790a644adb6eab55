"""Write the small Megatron indexed datasets of tests/bad-data/ (python3, no packages needed).

    python3 tests/bad-data/make_files.py

tiny.{bin,idx}       a valid dataset: 3 documents of uint16 ids < 256 (for the blend cases)
truncated.{bin,idx}  tiny with its .idx cut short in the sequence pointers
short.{bin,idx}      tiny with its .bin 10 bytes shorter than the index says
big-id.{bin,idx}     tiny with one token id 5000 (>= the model's vocab 256)
"""

import os
import struct

DIR = os.path.dirname(os.path.abspath(__file__))
DOCS = [[(7 * i + j) % 250 + 1 for j in range(n)] + [0] for i, n in enumerate([40, 25, 60])]


def write(name, docs, cut_idx=None, cut_bin=0):
    data = b"".join(struct.pack("<%dH" % len(d), *d) for d in docs)
    lengths = [len(d) for d in docs]
    pointers, p = [], 0
    for n in lengths:
        pointers.append(p)
        p += 2 * n
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
    idx += struct.pack("<QQ", len(docs), len(docs) + 1)
    idx += struct.pack("<%di" % len(docs), *lengths)
    idx += struct.pack("<%dq" % len(docs), *pointers)
    idx += struct.pack("<%dq" % (len(docs) + 1), *range(len(docs) + 1))
    if cut_idx is not None:
        idx = idx[:cut_idx]
    with open(os.path.join(DIR, name + ".idx"), "wb") as f:
        f.write(idx)
    with open(os.path.join(DIR, name + ".bin"), "wb") as f:
        f.write(data[: len(data) - cut_bin])


write("tiny", DOCS)
write("truncated", DOCS, cut_idx=34 + 12 + 10)
write("short", DOCS, cut_bin=10)
big = [list(d) for d in DOCS]
big[1][3] = 5000
write("big-id", big)
