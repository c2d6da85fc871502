"""Pictures of attention, masks, position encodings and training curves (matplotlib `Figure`s)."""

from tfformer.viz.plots import plot_attention, plot_history, plot_masks, plot_position_encoding

__all__ = ["plot_attention", "plot_history", "plot_masks", "plot_position_encoding"]
