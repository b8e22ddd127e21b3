"""What a stage reports, in the same shape everywhere: its headline metrics apart from the full
details and the wall-clock timings (`metrics`), the named pass/fail checks of verify and export
(`checks`), the timed steps behind the timings (`timing`) and the Markdown tables of every report
people read (`tables`). No torch at import."""
