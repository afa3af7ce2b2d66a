"""SequenceClassifier: a GRU over a padded batch of variable-length sequences, classified from each one's last step."""

from torch import Tensor, nn


class SequenceClassifier(nn.Module):
    """A per-step Linear + ReLU, a GRU, and a linear head on the GRU's state at each sequence's last real step.

    Padding needs no mask: the forward GRU's state at `lengths - 1` has seen only real steps. Gathering it (not
    `pack_padded_sequence`, which needs the lengths on the CPU) keeps the step free of host syncs.

    Args:
        num_classes: size of the output layer; linked from the data module by the CLI.
        in_channels: features per step; linked from the data module (the dataset's `in_channels`) by the CLI.
        embed: width of the per-step Linear + ReLU before the GRU (0: the raw features go to the GRU).
        hidden: GRU state size.
        num_layers: stacked GRU layers.
        dropout: dropout before the linear head (and between GRU layers when there are several).
    """

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        embed: int = 64,
        hidden: int = 64,
        num_layers: int = 1,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(in_channels, embed), nn.ReLU()) if embed else nn.Identity()
        gru_dropout = dropout if num_layers > 1 else 0.0
        self.gru = nn.GRU(embed or in_channels, hidden, num_layers, batch_first=True, dropout=gru_dropout)
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(hidden, num_classes))

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:  # (B, T, in_channels), (B,) -> (B, num_classes)
        out, _ = self.gru(self.embed(x))  # (B, T, hidden)
        last = (lengths.to(out.device) - 1).clamp(min=0).view(-1, 1, 1).expand(-1, 1, out.shape[-1])
        return self.head(out.gather(1, last).squeeze(1))
