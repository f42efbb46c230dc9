"""Small models shared by the engine tests: a Hugging Face GPT-2 with tied embeddings and a
custom model with shared and external parameters."""
import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 96


def gpt2(seed=0, layers=2, hidden=32, heads=2, tie=True):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=hidden, n_layer=layers, n_head=heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tie)
    model = GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    return model


class ScaleProvider(nn.Module):
    """A submodule whose forward returns its parameter."""

    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self):
        return self.scale


class Block(nn.Module):
    def __init__(self, dim, shared: nn.Linear):
        super().__init__()
        self.inner = nn.Linear(dim, dim)
        self.shared = shared  # the same module object in two blocks

    def forward(self, x):
        return x + torch.tanh(self.shared(torch.relu(self.inner(x))))


class Custom(nn.Module):
    """Shared module, tied weights, a parameter used by its parent, a returned parameter."""

    def __init__(self, dim=24, vocab=VOCAB):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        shared = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([Block(dim, shared), Block(dim, shared)])
        self.proj = nn.Linear(dim, dim)  # its weight is used by the parent, not by proj's forward
        self.gain = ScaleProvider(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.odd = nn.Parameter(torch.randn(7, 5) * 0.1)  # sizes no world size divides

    def forward(self, input_ids, labels=None):
        x = self.emb(input_ids)
        for b in self.blocks:
            x = b(x)
        x = x + F.linear(x, self.proj.weight, self.proj.bias)
        x = x * self.gain()
        x = x + (self.odd.sum() * 0.01)
        logits = self.head(x)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        return loss


class Stack(nn.Module):
    """Each parameter used exactly once: the paper's communication volume holds exactly."""

    def __init__(self, dim=32, depth=3):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim, dim) for _ in range(depth)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def build(kind, seed=0):
    torch.manual_seed(seed)
    if kind == "gpt2":
        return gpt2(seed)
    if kind == "custom":
        return Custom()
    if kind == "stack":
        return Stack()
    raise ValueError(kind)


def batches(steps, global_batch=6, seq=12, seed=1, distinct=2):
    """``steps`` batches cycling through ``distinct`` random ones, so learning is visible:
    the loss on batch i falls between its visits."""
    g = torch.Generator().manual_seed(seed)
    pool = [torch.randint(0, VOCAB, (global_batch, seq), generator=g) for _ in range(distinct)]
    return [pool[i % distinct] for i in range(steps)]


def train_into(model, opt, steps, losses):
    """GPT-2 steps on one rank, each loss appended before its backward and step, so a step
    that raises leaves the losses up to it behind; then the overlapped step is joined."""
    for ids in batches(steps):
        loss = model(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    opt.wait_step()


def train_losses(model, opt, kind, steps):
    """Train ``steps`` steps on each rank's slice of the global batches; return the global
    mean loss of every step (what a single process on the whole batch reports)."""
    return rank_losses(model, opt, batches(steps), lambda m, ids: loss_of(m, kind, ids))


def rank_losses(model, opt, global_batches, loss) -> list:
    """One step per global batch, each rank on its slice (``loss(model, ids)``); the global
    mean loss of every step."""
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    losses = []
    for ids in global_batches:
        out = loss(model, ids.chunk(world)[rank])
        out.backward()
        opt.step()
        opt.zero_grad()
        t = torch.tensor([out.item()])
        if dist.is_initialized():
            dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def train_accumulated(model, opt, kind, steps=3):
    """Train with two micro-batches per step (one rank); return the trained parameters,
    gathered, and close the engine."""
    import infinity

    for ids in batches(steps):
        for half in ids.chunk(2):
            loss_of(model, kind, half).backward()
        opt.step()
        opt.zero_grad()
    with infinity.GatheredParameters(list(model.parameters())):
        params = [p.detach().clone() for p in model.parameters()]
    opt.engine.close()
    return params


def loss_of(model, kind, ids):
    if kind == "gpt2":
        return model(input_ids=ids, labels=ids).loss
    if kind == "custom":
        return model(ids, labels=ids)
    raise ValueError(kind)
