// `attnkit train`: trains a transformer on a task into a run directory
// (checkpoints, metrics.jsonl); --resume continues the newest checkpoint.
// The Trainer (include/attnkit/train/trainer.h) does the work; this file maps
// flags to its options. docs/TRAINING.md describes the run directory.
#include <attnkit/train/checkpoint.h>
#include <attnkit/train/distributed.h>
#include <attnkit/train/trainer.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <thread>

#include "commands.h"
#include "launch.h"

namespace attnkit::cli {

namespace {

struct TrainFlags {
  std::string task = "char-lm", data, architecture, positions = "sinusoidal", norm = "pre", display = "auto";
  std::string dtype = "float32", block = "classic", normalization = "layer", feed_forward = "relu";
  std::vector<std::string> attention;
  int64_t layers = 0, width = 0, heads = 0, kv_heads = 0, ffn = 0, context = 0, batch = 0, steps = 0, copy_length = 64;
  int64_t warmup = 0, checkpoint_every = 0, log_every = 0, eval_every = 0, eval_batches = 0, conv_width = 0,
          max_length = 0;
  double lr = 0, min_lr = 0, dropout = 0, attention_dropout = 0, clip = 0, weight_decay = 0, rotary_fraction = 1;
  uint64_t seed = 0;
  int threads = 0;
  std::string out;
  bool resume = false, untied = false, shared_weights = false, no_bias = false;
  // Data parallel (not stored in checkpoints: a run may resume with any number of processes).
  int nproc = 1, world_size = 1, rank = 0, master_port = train::kDefaultMasterPort;
  std::string master_addr = "127.0.0.1";
  double dist_timeout = 60, bucket_mb = 25;
  bool no_overlap = false;
};

/// The text of an exception (c10::Error without its backtrace).
std::string message_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

}  // namespace

void add_train_command(CLI::App& app) {
  auto f = std::make_shared<TrainFlags>();
  const models::TransformerOptions m;
  const train::TrainerOptions t;
  f->layers = m.layers(); f->width = m.width(); f->heads = m.heads(); f->kv_heads = m.kv_heads(); f->ffn = m.ffn();
  f->dropout = m.dropout(); f->attention_dropout = m.attention_dropout();
  f->conv_width = m.conv_width(); f->rotary_fraction = m.rotary_fraction();
  f->max_length = m.max_length();
  f->context = t.context(); f->batch = t.batch(); f->steps = t.steps(); f->lr = t.lr();
  f->min_lr = t.min_lr(); f->warmup = t.warmup(); f->clip = t.clip(); f->weight_decay = t.weight_decay();
  f->seed = t.seed(); f->checkpoint_every = t.checkpoint_every(); f->log_every = t.log_every();
  f->eval_every = t.eval_every(); f->eval_batches = t.eval_batches();

  auto* cmd = app.add_subcommand(
      "train",
      "Train a transformer on a task into a run directory (checkpoints, metrics.jsonl). "
      "With --resume, flags not given are taken from the newest checkpoint and flags given must "
      "match it (except --steps, --threads and the logging/evaluation/checkpoint cadence)");
  cmd->add_option("--task", f->task, "char-lm (next character, bits per character), masked-char (masked characters "
                  "seen from both sides, bits per masked character) or copy (masked copy task)")
      ->check(CLI::IsMember({"char-lm", "masked-char", "copy"}))->capture_default_str();
  cmd->add_option("--data", f->data, "char-lm: the directory `attnkit data char-lm` wrote (train/valid/test.txt)");
  cmd->add_option("--copy-length", f->copy_length, "copy: symbols per half")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--attention", f->attention,
                  "Mechanism spec NAME[:key=value,...] for every block; repeat once per block (bottom "
                  "first) for one spec per block (default: full)")
      ->allow_extra_args(false);
  cmd->add_option("--architecture", f->architecture,
                  "decoder or encoder (default: the task's: char-lm decoder, masked-char and copy encoder)")
      ->check(CLI::IsMember({"decoder", "encoder"}));
  cmd->add_option("--layers", f->layers, "Blocks")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--width", f->width, "Model width d")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--heads", f->heads, "Attention heads")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--kv-heads", f->kv_heads,
                  "Key/value heads, a divisor of --heads (grouped-query attention; 1: multi-query); "
                  "0: as many as --heads")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--ffn", f->ffn, "Hidden width of the feed-forward network")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--dropout", f->dropout, "Dropout on every sub-layer output")->check(CLI::Range(0.0, 1.0))->capture_default_str();
  cmd->add_option("--attention-dropout", f->attention_dropout,
                  "Dropout on the attention weights, inside the exact kernel (attention 'full'), in [0, 1)")
      ->check(CLI::Range(0.0, 1.0))->capture_default_str();
  // (Checked by models::positions_from_string, whose error names the schemes.)
  cmd->add_option("--positions", f->positions,
                  "none, or schemes joined by '+' (conv+learned, conv+relative, ...): sinusoidal, learned, relative, "
                  "conv, alibi (linear distance penalties inside the kernels of exact and sparse attention), rope (rotary positions)")
      ->capture_default_str();
  cmd->add_option("--conv-width", f->conv_width, "conv positions: filter width")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--max-length", f->max_length,
                  "sinusoidal and learned positions: rows of the table, the longest sequence the model takes "
                  "(evaluation and generation included)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--rotary-fraction", f->rotary_fraction,
                  "rope positions: the fraction of each head's features rotated (rounded down to an even count)")
      ->check(CLI::Range(0.0, 1.0))->capture_default_str();
  cmd->add_option("--norm", f->norm, "pre or post")->check(CLI::IsMember({"pre", "post"}))->capture_default_str();
  cmd->add_option("--block", f->block,
                  "classic (seed 003's block: layer norm, relu network, biases) or llama (pre-norm RMSNorm, SwiGLU "
                  "network, no biases, rope positions; --positions, --norm, --normalization and --feed-forward "
                  "given beside it win)")
      ->check(CLI::IsMember({"classic", "llama"}))->capture_default_str();
  cmd->add_option("--normalization", f->normalization, "layer (layer norm) or rms (RMSNorm)")
      ->check(CLI::IsMember({"layer", "rms"}))->capture_default_str();
  cmd->add_option("--feed-forward", f->feed_forward,
                  "relu, ff2(relu(ff1 h)), or swiglu, ff2(silu(ff1 h) * ff3 h): three --ffn-wide matrices "
                  "(at --ffn 2/3 of relu's, the same parameters)")
      ->check(CLI::IsMember({"relu", "swiglu"}))->capture_default_str();
  cmd->add_flag("--no-bias", f->no_bias,
                "No biases in the blocks' linear layers and layer norms, nor in an untied output layer");
  cmd->add_flag("--untied", f->untied, "An output layer of its own instead of the embedding matrix");
  cmd->add_flag("--shared-weights", f->shared_weights,
                "Universal transformer: one block's weights applied --layers times (one --attention spec)");
  cmd->add_option("--context", f->context, "Tokens per training sequence")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--batch", f->batch, "Sequences per step")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--steps", f->steps, "Optimiser steps of the whole run")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--lr", f->lr, "Peak learning rate (AdamW)")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--min-lr", f->min_lr, "Learning rate at the end of the cosine decay")->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--warmup", f->warmup, "Steps of linear warm-up")->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--clip", f->clip, "Global gradient-norm bound (0: none)")->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--weight-decay", f->weight_decay, "AdamW's decoupled weight decay (matrices only)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--seed", f->seed, "Seed of the initial weights, the data order and dropout")->capture_default_str();
  cmd->add_option("--threads", f->threads, "Threads (default: all cores)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--checkpoint-every", f->checkpoint_every, "Steps between checkpoints (one is always written at the end)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--log-every", f->log_every, "Steps per progress line and metrics.jsonl record")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--eval-every", f->eval_every, "Steps between validations (0: only at the end)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--eval-batches", f->eval_batches, "Validation batches per evaluation (0: the whole split)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--dtype", f->dtype,
                  "Compute dtype: float32, or bf16 (alias bfloat16): mixed precision, the forward and backward "
                  "passes in bfloat16 on a copy of the model refreshed every step; float32 loss, weights, "
                  "optimiser state, all-reduce and checkpoints; validation in bf16 (docs/TRAINING.md)")
      ->check([](const std::string& value) -> std::string {
        try {
          train::dtype_from_string(value);
        } catch (const std::exception& e) {
          return e.what();
        }
        return "";
      })
      ->capture_default_str();
  cmd->add_option("--display", f->display, "Progress: auto (a live line on a terminal, else plain lines), live, plain, quiet")
      ->check(CLI::IsMember({"auto", "live", "plain", "quiet"}))->capture_default_str();
  cmd->add_option("--out", f->out, "Run directory")->required();
  cmd->add_flag("--resume", f->resume, "Continue from the newest checkpoint in --out");
  // Data parallel (docs/TRAINING.md, "Data-parallel training").
  cmd->add_option("--nproc", f->nproc,
                  "Data parallel on this machine: start P worker processes (each reads batch/P sequences of every "
                  "step; rank 0 prints and writes the run directory); default threads per worker: cores/P")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--world-size", f->world_size,
                  "Data parallel over machines: processes in the job (default: $WORLD_SIZE); needs --rank")
      ->check(CLI::Range(1, 65536));
  cmd->add_option("--rank", f->rank, "This process's rank in [0, world size) (default: $RANK); rank 0 serves the rendezvous");
  cmd->add_option("--master-addr", f->master_addr, "Rank 0's address (default: $MASTER_ADDR, else 127.0.0.1)");
  cmd->add_option("--master-port", f->master_port,
                  "Rank 0's TCPStore port (default: $MASTER_PORT, else 29500; with --nproc the launcher serves the store on a port the system picks)");
  cmd->add_option("--dist-timeout", f->dist_timeout,
                  "Seconds a worker waits for the others (rendezvous, every all-reduce) before it stops with an error")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--bucket-mb", f->bucket_mb, "Gradient all-reduce bucket size in MiB")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_flag("--no-overlap", f->no_overlap,
                "All-reduce the gradients after the backward pass and a barrier instead of during it (measures the all-reduce alone)");

  cmd->callback([f, cmd] {
    auto given = [cmd](const std::string& flag) { return cmd->count(flag) > 0; };
    // Start from the stored options when resuming, else from the defaults.
    models::TransformerOptions model;
    train::TrainerOptions trainer;
    tasks::TaskOptions task{f->task, f->data, f->copy_length};
    bool from_checkpoint = false;
    if (f->resume && !train::list_checkpoints(f->out).empty()) {
      auto stored = train::read_stored_options(f->out);
      model = stored.model;
      trainer = stored.trainer;
      task = stored.task;
      from_checkpoint = true;
    } else {
      model.vocab_size(0);  // the task's
      model.architecture(models::architecture_from_string(
          !f->architecture.empty() ? f->architecture : f->task == "char-lm" ? "decoder" : "encoder"));
      model.positions(models::positions_from_string(f->positions))
          .norm(models::norm_from_string(f->norm))
          .layers(f->layers).width(f->width).heads(f->heads).kv_heads(f->kv_heads).ffn(f->ffn).dropout(f->dropout)
          .attention_dropout(f->attention_dropout)
          .conv_width(f->conv_width).rotary_fraction(f->rotary_fraction).max_length(f->max_length)
          .tie_embeddings(!f->untied).shared_weights(f->shared_weights)
          .normalization(models::normalization_from_string(f->normalization))
          .feed_forward(models::feed_forward_from_string(f->feed_forward)).bias(!f->no_bias);
      if (f->block == "llama") {
        model.llama_block();
        // The flags given beside it refine it.
        if (given("--positions")) model.positions(models::positions_from_string(f->positions));
        if (given("--norm")) model.norm(models::norm_from_string(f->norm));
        if (given("--normalization")) model.normalization(models::normalization_from_string(f->normalization));
        if (given("--feed-forward")) model.feed_forward(models::feed_forward_from_string(f->feed_forward));
      }
      if (!f->attention.empty()) model.attention(f->attention);
      trainer.context(f->context).batch(f->batch).steps(f->steps).lr(f->lr).min_lr(f->min_lr)
          .warmup(f->warmup).clip(f->clip).weight_decay(f->weight_decay).seed(f->seed)
          .checkpoint_every(f->checkpoint_every).log_every(f->log_every).eval_every(f->eval_every)
          .eval_batches(f->eval_batches).dtype(train::dtype_from_string(f->dtype));
      if (f->task != "copy" && f->data.empty())
        throw CLI::ValidationError("--data", "--task " + f->task +
                                                 " needs --data DIR (see `attnkit data char-lm`)");
    }
    if (from_checkpoint) {
      // Flags given on the command line override the stored options; the
      // Trainer then refuses the ones that would change the trajectory.
      if (given("--task")) task.name = f->task;
      if (given("--data")) task.data_dir = f->data;
      if (given("--copy-length")) task.copy_length = f->copy_length;
      if (given("--architecture")) model.architecture(models::architecture_from_string(f->architecture));
      // --block first: the flags given beside it refine it.
      if (given("--block") && f->block == "llama") model.llama_block();
      if (given("--block") && f->block == "classic")
        model.normalization(models::Normalization::layer).feed_forward(models::FeedForward::relu).bias(true);
      if (given("--positions")) model.positions(models::positions_from_string(f->positions));
      if (given("--norm")) model.norm(models::norm_from_string(f->norm));
      if (given("--normalization")) model.normalization(models::normalization_from_string(f->normalization));
      if (given("--feed-forward")) model.feed_forward(models::feed_forward_from_string(f->feed_forward));
      if (given("--no-bias")) model.bias(!f->no_bias);
      if (given("--layers")) model.layers(f->layers);
      if (given("--width")) model.width(f->width);
      if (given("--heads")) model.heads(f->heads);
      if (given("--kv-heads")) model.kv_heads(f->kv_heads);
      if (given("--ffn")) model.ffn(f->ffn);
      if (given("--dropout")) model.dropout(f->dropout);
      if (given("--attention-dropout")) model.attention_dropout(f->attention_dropout);
      if (given("--conv-width")) model.conv_width(f->conv_width);
      if (given("--max-length")) model.max_length(f->max_length);
      if (given("--rotary-fraction")) model.rotary_fraction(f->rotary_fraction);
      if (given("--untied")) model.tie_embeddings(!f->untied);
      if (given("--shared-weights")) model.shared_weights(f->shared_weights);
      if (given("--attention")) model.attention(f->attention);
      if (given("--context")) trainer.context(f->context);
      if (given("--batch")) trainer.batch(f->batch);
      if (given("--steps")) trainer.steps(f->steps);
      if (given("--lr")) trainer.lr(f->lr);
      if (given("--min-lr")) trainer.min_lr(f->min_lr);
      if (given("--warmup")) trainer.warmup(f->warmup);
      if (given("--clip")) trainer.clip(f->clip);
      if (given("--weight-decay")) trainer.weight_decay(f->weight_decay);
      if (given("--seed")) trainer.seed(f->seed);
      if (given("--checkpoint-every")) trainer.checkpoint_every(f->checkpoint_every);
      if (given("--log-every")) trainer.log_every(f->log_every);
      if (given("--eval-every")) trainer.eval_every(f->eval_every);
      if (given("--eval-batches")) trainer.eval_batches(f->eval_batches);
      if (given("--dtype")) trainer.dtype(train::dtype_from_string(f->dtype));
    }
    // Data parallel: --nproc (a launcher, or one of its workers), or
    // --world-size/--rank/--master-* (or their environment variables).
    const bool worker = launched_worker();
    train::DistributedOptions dist;
    dist.timeout(f->dist_timeout)
        .bucket_bytes(static_cast<int64_t>(f->bucket_mb * (1 << 20)))
        .overlap(!f->no_overlap);
    if (given("--nproc") && (given("--world-size") || given("--rank")))
      throw CLI::ValidationError("--nproc", "--nproc starts a whole job on this machine, --world-size/--rank join "
                                            "a job over several machines: give one or the other");
    if (worker) {
      train::distributed_from_environment(dist);  // set by the launcher
    } else if (!given("--nproc")) {
      const bool env_world = train::distributed_from_environment(dist);
      if (given("--world-size")) dist.world_size(f->world_size);
      if (given("--rank")) dist.rank(f->rank);
      if (given("--master-addr")) dist.master_addr(f->master_addr);
      if (given("--master-port")) dist.master_port(f->master_port);
      if ((given("--world-size") || env_world) && !given("--rank") && std::getenv("RANK") == nullptr)
        throw CLI::ValidationError("--rank", "a job of --world-size " + std::to_string(dist.world_size()) +
                                                 " needs this process's --rank (or RANK)");
    }
    int threads = f->threads;
    if (given("--nproc") && !given("--threads"))
      threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / f->nproc);
    trainer.threads(threads).out(f->out).resume(f->resume);
    trainer.display(f->display == "live"    ? train::Display::live
                    : f->display == "plain" ? train::Display::plain
                    : f->display == "quiet" ? train::Display::quiet
                                            : train::Display::automatic);

    if (given("--nproc") && !worker && f->nproc > 1) {
      // The launcher: check everything once (the Trainer's constructor
      // validates the options, the batch against P and the run directory
      // without writing anything), then start the workers.
      dist.world_size(f->nproc).rank(0);
      if (given("--master-addr")) dist.master_addr(f->master_addr);
      if (given("--master-port")) dist.master_port(f->master_port);
      train::validate(dist);
      { train::Trainer check(trainer, model, task, dist); }
      LaunchOptions launch;
      launch.nproc = f->nproc;
      launch.master_addr = dist.master_addr();
      launch.master_port = given("--master-port") ? f->master_port : 0;
      launch.grace_seconds = std::min(10.0, f->dist_timeout);
      launch.store_timeout = f->dist_timeout;
      const int status = launch_workers(launch, command_line());
      if (status != 0) throw CLI::RuntimeError(status);
      return;
    }
    if (given("--nproc") && !worker) dist = train::DistributedOptions{};  // --nproc 1: one process
    const bool distributed = dist.world_size() > 1;
    train::TrainResult result;
    std::unique_ptr<train::Trainer> run_ptr;
    try {
      run_ptr = std::make_unique<train::Trainer>(trainer, model, task, dist);
      result = run_ptr->run();
    } catch (const std::exception& e) {
      if (!distributed) throw;
      // Which worker says what: "rank R: ..." (once).
      const std::string text = message_of(e);
      throw std::runtime_error(text.rfind("rank ", 0) == 0 ? text : "rank " + std::to_string(dist.rank()) + ": " + text);
    }
    auto& run = *run_ptr;
    if (dist.rank() != 0) return;  // rank 0 reports the run
    std::cout << (result.interrupted ? "interrupted at step " : "trained to step ") << result.step << " of "
              << run.options().steps() << "; checkpoint " << result.checkpoint;
    if (result.validated)
      std::cout << "; valid loss " << result.valid.loss() << ", " << run.task().metric_name() << " "
                << run.task().metric(result.valid);
    std::cout << "\n";
  });
}

}  // namespace attnkit::cli
