"""MaxSim over packed ragged sequences (cu_seqlens) and pair lists."""
