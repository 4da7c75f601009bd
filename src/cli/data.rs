//! `pipeline data prepare`: text in, challenge-format shards out.

/// Writes the shards `opts` describe and prints what it wrote.
pub fn command(opts: crate::data::prepare::PrepareOptions) -> i32 {
    let t = std::time::Instant::now();
    match crate::data::prepare::prepare(&opts) {
        Ok(m) => {
            out!(
                "{}: val {} docs, {} tokens in {} shard(s); train {} docs, {} tokens in {} shard(s); tokenizer {} ({} pieces); {:.1} s",
                opts.out.display(),
                m.val.docs,
                m.val.tokens,
                m.val.shards.len(),
                m.train.docs,
                m.train.tokens,
                m.train.shards.len(),
                opts.tokenizer.display(),
                m.tokenizer["vocab_size"],
                t.elapsed().as_secs_f64()
            );
            if let Some(bytes) = m.val.sidecar_bytes {
                out!(
                    "caseops: val byte sidecar in {} file(s) (fineweb_val_bytes_*.bin), {bytes} bytes of original text; val_bpb is charged on them",
                    m.val.byte_sidecars.len()
                );
            }
            0
        }
        Err(e) => {
            err!("error: {e:#}");
            1
        }
    }
}
