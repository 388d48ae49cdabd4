"""AMX tiles for the integer dense / matmul: ``tdpbusd`` (u8 × s8 → int32, 16 × 16 outputs of
64 products each per instruction) where the CPU has it (Sapphire Rapids and later).

The operands are the ones ``vpdpbusd`` reads (:mod:`.dense_int8`): uint8 activations in rows,
int8 weights packed ``[N/nb, K/4, nb·4]``, whose rows of 64 bytes (16 columns × 4 products)
are an AMX ``B`` tile as they are. The products are the same integers, so the results are
too. The rule (:func:`~.dense_int8.schedule_dense_int8`) ``blockize``\\ s the loops of one
``rows × cols`` output tile over the whole reduction (up to 2 × 2 accumulator tiles: 32 × 32
outputs, 8 tile registers with the two ``A`` and two ``B`` tiles) and marks it
(:func:`mark_tile`); :func:`lower_tile` then writes the block as the AMX program: the tile
configuration, the accumulators zeroed, per 64 of the reduced axis two ``A`` and two ``B``
loads and four ``tdpbusd``, the accumulators stored into the tile's int32 buffer (which the
epilogue reads), the tiles released.

Linux grants a process the tile registers on request only (``arch_prctl``,
``ARCH_REQ_XCOMP_PERM``): each kernel holding a tile asks first, once per call, and fails with
an error, not a fault, where the system refuses.

One thread of a Sapphire Rapids core, char_gpt's layers at 128 rows (K = 256 … 1024, N = 128 …
1024): 1.8–3× faster than ``vpdpbusd`` at its peak, the attention matmuls 1.2–1.7×, its GELU
layer 1.45× (the epilogue's arithmetic then costs as much as the products).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx

ANNOTATION = "rangeprof.amx"
ROWS = COLUMNS = 16  # outputs of one accumulator tile
DEPTH = 64  # products per output and tile step (bytes of a tile row)
_TILES = 8
_ARCH_PRCTL, _REQ_XCOMP_PERM, _XTILEDATA = 158, 0x1023, 18  # Linux x86-64


def available(target: tvm.target.Target | None) -> bool:
    """Whether ``target`` has the AMX tile and int8 instructions."""
    return target is not None and all(
        tvm.target.codegen.target_has_features(f, target) for f in ("amx-tile", "amx-int8")
    )


def fits(rows: int, columns: int, depth: int) -> bool:
    """Whether a ``rows × columns`` output over ``depth`` products tiles exactly."""
    return rows % ROWS == 0 and columns % COLUMNS == 0 and depth % DEPTH == 0


def mark_tile(sch: s_tir.Schedule, loop) -> None:
    """Blockizes ``loop`` (an output tile's rows, its columns and the whole reduction inside)
    for :func:`lower_tile`."""
    sch.annotate(sch.blockize(loop), ANNOTATION, True)


def _call(name: str, *args) -> tirx.Evaluate:
    return tirx.Evaluate(tirx.call_llvm_intrin("void", name, *args))


def _tile(index: int) -> tirx.IntImm:
    return tirx.const(index, "int8")


def _address(buffer, indices, at: dict) -> tirx.PrimExpr:
    """The address of ``buffer[indices]`` with the block variables ``at`` substituted."""
    moved = [tvm_ffi.structural_mutate(i, (tirx.Var, lambda v, _m: at.get(v, v))) for i in indices]
    return tirx.address_of(tirx.BufferLoad(buffer, moved))


def _row_bytes(buffer) -> tirx.PrimExpr:
    bits = tvm.runtime.DataType(str(buffer.dtype)).bits
    return tirx.const(int(buffer.shape[-1]) * bits // 8, "int64")


def _configuration(config) -> list:
    """Palette 1, every tile 16 rows of 64 bytes (``ldtilecfg``'s 64-byte layout)."""
    values = [0] * 64
    values[0] = 1
    for t in range(_TILES):
        values[16 + 2 * t], values[48 + t] = DEPTH, ROWS
    stores = [tirx.BufferStore(config, tirx.const(v, "uint8"), [i]) for i, v in enumerate(values)]
    return [*stores, _call("llvm.x86.ldtilecfg", tirx.address_of(tirx.BufferLoad(config, [0])))]


class _Tile:
    """One marked block: its output tile's extents and the accesses of its
    multiply-accumulate, the block variables ``m``, ``n``, ``k`` of the inner block."""

    def __init__(self, block: s_tir.SBlock, accesses):
        extents, stmt = [], block.body
        while isinstance(stmt, tirx.For):
            extents.append(int(stmt.extent))
            stmt = stmt.body
        self.rows, self.columns, self.depth = extents
        inner = stmt.block
        self.store, self.data, self.weight = accesses(inner)
        self.m, self.n, self.k = (iv.var for iv in inner.iter_vars)
        self.zero = tirx.const(0, str(self.m.ty))

    def at(self, row: int = 0, column: int = 0, k=None) -> dict:
        index = str(self.m.ty)
        k = self.zero if k is None else k
        return {self.m: tirx.const(row, index), self.n: tirx.const(column, index), self.k: k}

    def program(self, config) -> list:
        a_tiles, b_tiles = self.rows // ROWS, self.columns // COLUMNS
        acc = [
            [a_tiles + b_tiles + i * b_tiles + j for j in range(b_tiles)] for i in range(a_tiles)
        ]
        step = tirx.Var("k_tile", str(self.k.ty))
        data, weight = self.data, self.weight
        steps = [
            _call("llvm.x86.tileloadd64", _tile(i), self._address(data, ROWS * i, 0, step),
                  _row_bytes(data.source))
            for i in range(a_tiles)
        ] + [
            _call("llvm.x86.tileloadd64", _tile(a_tiles + j),
                  self._address(weight, 0, COLUMNS * j, step), _row_bytes(weight.source))
            for j in range(b_tiles)
        ]  # fmt: skip
        steps += [
            _call("llvm.x86.tdpbusd", _tile(acc[i][j]), _tile(i), _tile(a_tiles + j))
            for i in range(a_tiles)
            for j in range(b_tiles)
        ]
        loop = tirx.For(
            step, self.zero, tirx.const(self.depth // DEPTH, str(self.k.ty)),
            tirx.ForKind.SERIAL, tirx.SeqStmt(steps),
        )  # fmt: skip
        # The accumulator buffer holds this output tile alone once allocated (the epilogue is
        # computed at the tile): its rows are ``columns`` int32 apart.
        stride = tirx.const(self.columns * 4, "int64")
        stored = [
            _call("llvm.x86.tilestored64", _tile(acc[i][j]),
                  _address(self.store.buffer, self.store.indices, self.at(ROWS * i, COLUMNS * j)),
                  stride)
            for i in range(a_tiles)
            for j in range(b_tiles)
        ]  # fmt: skip
        zeroed = [_call("llvm.x86.tilezero", _tile(t)) for row in acc for t in row]
        return [*_configuration(config), *zeroed, loop, *stored, _call("llvm.x86.tilerelease")]

    def _address(self, load, row: int, column: int, step) -> tirx.PrimExpr:
        return _address(load.source, load.indices, self.at(row, column, step * DEPTH))


def lower_tile(block: s_tir.SBlock, accesses) -> s_tir.SBlock:
    """The AMX program of a block :func:`mark_tile` marked, its init dropped (the accumulators
    start at zero); ``accesses(inner)`` gives the store, data and weight accesses of the
    multiply-accumulate block inside."""
    config = tirx.decl_buffer((64,), "uint8", name="amx_config")
    return s_tir.SBlock(
        block.iter_vars,
        block.reads,
        block.writes,
        block.name_hint,
        tirx.SeqStmt(_Tile(block, accesses).program(config)),
        None,
        [*block.alloc_buffers, config],
        block.match_buffers,
        {key: v for key, v in block.annotations.items() if key != ANNOTATION},
    )


def _permission() -> tirx.Stmt:
    """The request for the tile registers, failing the call where the system refuses."""
    request = [tirx.const(v, "int64") for v in (_ARCH_PRCTL, _REQ_XCOMP_PERM, _XTILEDATA)]
    granted = tirx.call_extern("int64", "syscall", *request) == tirx.const(0, "int64")
    message = tvm.ir.StringImm("the system refused the AMX tile registers (arch_prctl)")
    # This wheel's binding takes the condition first, whatever its parameter names say.
    return tirx.AssertStmt(granted, tvm.ir.StringImm("RuntimeError"), [message])


def _lowered(func: tirx.PrimFunc, accesses) -> tuple[tirx.PrimFunc, int]:
    """``func`` with its marked blocks lowered (:func:`lower_tile`), and how many there were."""
    found = []

    def lower(block: s_tir.SBlock, mutator):
        block = mutator.default_mutate(block)
        if ANNOTATION not in block.annotations:
            return block
        found.append(block)
        return lower_tile(block, accesses)

    return tvm_ffi.structural_mutate(func, (s_tir.SBlock, lower)), len(found)


def lower_tiles(mod: tvm.IRModule, accesses) -> tvm.IRModule:
    """Each marked block of ``mod``'s kernels → its AMX program (:func:`lower_tile`), and the
    request for the tile registers first in each kernel that holds one."""
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc):
            func, tiles = _lowered(func, accesses)
            mod[gvar] = _requesting(func) if tiles else func
    return mod


def _requesting(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with :func:`_permission` before its root block's body."""
    realize = func.body
    root = realize.block
    body = tirx.SeqStmt([_permission(), root.body])
    new_root = s_tir.SBlock(
        root.iter_vars, root.reads, root.writes, root.name_hint, body, root.init,
        root.alloc_buffers, root.match_buffers, root.annotations,
    )  # fmt: skip
    new_realize = s_tir.SBlockRealize(realize.iter_values, realize.predicate, new_root)
    return func.with_body(new_realize)
