//! How ranks split a pass over a list of work between them: contiguous shares (the records'
//! `⌊n·r/W⌋ … ⌊n·(r+1)/W⌋`), and the agreement that lets a rank stop such a pass without
//! leaving the others waiting in a collective.
//!
//! A pass over shares of unequal length still runs the same number of rounds on every rank
//! ([`rounds`]): a rank whose share is done takes part in the remaining agreements with nothing
//! to do, so that every rank calls the same collectives in the same order.

use std::ops::Range;

use super::{Collective, ReduceOp};

/// Rank `rank`'s contiguous share of `n` items among `world` ranks: `[⌊n·r/W⌋, ⌊n·(r+1)/W⌋)`.
/// The shares tile `0..n` in rank order and differ in length by at most one.
pub fn share(n: usize, rank: usize, world: usize) -> Range<usize> {
    let world = world.max(1);
    n * rank / world..n * (rank + 1) / world
}

/// Rounds of `per_round` items a pass over `n` items shared by `world` ranks takes on its
/// slowest rank: the number every rank runs.
pub fn rounds(n: usize, world: usize, per_round: usize) -> usize {
    (0..world.max(1)).map(|r| share(n, r, world).len().div_ceil(per_round.max(1))).max().unwrap_or(0)
}

/// Whether every rank wants to go on (`mine` is this rank's wish): true only when all do. One
/// rank's stop (Ctrl-C) thus stops every rank at the same round. A world of one without a
/// transport asks nobody.
pub fn all_go_on(c: &dyn Collective, mine: bool) -> anyhow::Result<bool> {
    if c.is_identity() {
        return Ok(mine);
    }
    let stop = c.all_reduce_host(&[if mine { 0.0 } else { 1.0 }], ReduceOp::Max)?;
    Ok(stop[0] == 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_tile_the_items_in_rank_order() {
        for n in 0..40 {
            for world in 1..9 {
                let mut next = 0;
                for r in 0..world {
                    let s = share(n, r, world);
                    assert_eq!(s.start, next, "n {n} world {world} rank {r}");
                    assert!(s.len() == n / world || s.len() == n / world + 1);
                    next = s.end;
                }
                assert_eq!(next, n);
            }
        }
        assert_eq!(share(10, 1, 4), 2..5);
    }

    #[test]
    fn rounds_cover_the_longest_share() {
        assert_eq!(rounds(10, 4, 2), 2);
        assert_eq!(rounds(9, 2, 4), 2);
        assert_eq!(rounds(0, 3, 4), 0);
        assert_eq!(rounds(33, 1, 32), 2);
        for n in 0..50 {
            for w in 1..5 {
                for p in 1..6 {
                    let most = (0..w).map(|r| share(n, r, w).len()).max().unwrap();
                    assert!(rounds(n, w, p) * p >= most && (rounds(n, w, p) == 0 || (rounds(n, w, p) - 1) * p < most));
                }
            }
        }
    }

    #[test]
    fn a_world_of_one_asks_nobody() {
        let one = crate::dist::single::Single;
        assert!(all_go_on(&one, true).unwrap());
        assert!(!all_go_on(&one, false).unwrap());
    }
}
