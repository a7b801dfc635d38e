"""`SlidingPages`: the block table of a lease that slides a window, giving back the pages behind it.

A model whose every layer attends only to its last `window` positions never reads a key behind the window
again. Such a lease is priced at the positions it holds at once (`admission.window.paged_hold_positions`)
and leases that many blocks at admission. Before each write it slides (`decode_slide` every
`eviction_interval` decode steps, `prefill_slide` before each prompt chunk): the pages wholly behind the
threshold leave its table, which marks them `RELEASED`, and join its spare pages; the pages its new
positions need are installed from the spares, most recently released first. So the store and the ledger
count the same blocks throughout (the lease's blocks never change, only which position each holds), and a
released page is reused by the same lease, never read again through its old position.

Why the spares stay in the lease instead of going back to the shared pool: the ledger reserved the hold
bound for the row's whole life, so a page given to the pool could not be promised to anyone else anyway,
and a lease that owns its spares can never find the pool empty when it grows. The hold bound covers what
the table can reach between two slides (tested against the arithmetic in `tests/runtime/kv/`).

Pure Python over block ids; `paged_kv.PagedKvStore` keeps a sliding sequence's table tensor in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrox_batch.admission.window import Release, SlideRequest, WindowPolicy, decode_slide, prefill_slide

#: A table entry whose page was given back: any read through it is out of range (a negative block id).
RELEASED = -1


@dataclass(slots=True)
class SlidingPages:
    """Which block holds each page of a sliding sequence: `pages[i]` holds positions `[i * page, (i + 1) *
    page)`, `RELEASED` once behind the window; `spare` holds the leased blocks no page uses now."""

    policy: WindowPolicy
    spare: list[int]
    pages: list[int] = field(default_factory=list)
    released: int = 0  # positions [0, released) were given back: whole pages
    decode_steps: int = 0  # one-token writes so far (its decode steps)

    def before_write(self, length: int, count: int) -> bool:
        """Slide, then install the pages that positions `[length, length + count)` need; whether the table
        changed. Raises ValueError, changing nothing, when the lease has too few pages for them."""
        page = self.policy.page_size
        last = (length + count - 1) // page
        # A one-token write is a decode step (or a prompt's one-token chunk: it slides like one, which
        # keeps the same bound).
        steps = self.decode_steps + 1 if count == 1 else self.decode_steps
        slide = self._slide(length, count, steps)
        freed = 0 if slide is None else (slide.end - slide.start) // page
        missing = last + 1 - len(self.pages)
        if missing > len(self.spare) + freed:
            raise ValueError(f"would reach {length + count} positions but its sliding KV lease holds "
                             f"{len(self.spare) + self._held()} pages of {page} positions, from position "
                             f"{self.released} on")
        self.decode_steps = steps
        if slide is not None:
            for index in range(slide.start // page, slide.end // page):
                self.spare.append(self.pages[index])
                self.pages[index] = RELEASED
            self.released = slide.end
        for _ in range(max(0, missing)):
            self.pages.append(self.spare.pop())
        return slide is not None or missing > 0

    def _slide(self, length: int, count: int, steps: int) -> Release | None:
        # Nothing is locked: a sliding lease shares no page. The interval counts the row's own decode
        # steps, where the upstream counts the worker's forwards: the same rate, and what a row holds
        # never depends on what it is batched with.
        request = SlideRequest(length, self.released, 0, steps)
        if count == 1:
            return decode_slide(request, self.policy, steps)
        return prefill_slide(request, self.policy)

    def _held(self) -> int:
        return sum(1 for block in self.pages if block != RELEASED)
