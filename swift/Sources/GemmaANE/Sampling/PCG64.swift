/// numpy's default random stream, bit for bit: `np.random.default_rng(seed)` is a `SeedSequence(seed)` hashing
/// the seed into PCG64's 128-bit state and increment, and `Generator.random()` is the next 64-bit output's top
/// 53 bits as a double. The Python sampler draws from exactly this stream, so the same seed gives the same tokens.
public struct PCG64: Sendable {
    private var state: UInt128
    private let increment: UInt128

    // PCG's default 128-bit LCG multiplier (pcg_setseq_128).
    private static let multiplier = UInt128(2_549_297_995_355_413_924) << 64 | UInt128(4_865_540_595_714_422_341)

    /// The stream `np.random.default_rng(seed)` draws from (numpy takes the seed as an unsigned integer: the Python
    /// sampler passes a signed seed's 64-bit two's complement, `UInt64(bitPattern:)` here).
    public init(seed: UInt64) {
        let words = SeedSequence(entropy: seed).generateState(words64: 4)
        let initState = UInt128(words[0]) << 64 | UInt128(words[1])
        let initSequence = UInt128(words[2]) << 64 | UInt128(words[3])
        // pcg_setseq_128_srandom_r
        state = 0
        increment = initSequence << 1 | 1
        step()
        state &+= initState
        step()
    }

    private mutating func step() {
        state = state &* Self.multiplier &+ increment
    }

    /// The next 64-bit output: numpy steps first, then applies XSL-RR to the new state.
    public mutating func nextUInt64() -> UInt64 {
        step()
        let folded = UInt64(truncatingIfNeeded: state >> 64) ^ UInt64(truncatingIfNeeded: state)
        let rotation = UInt64(truncatingIfNeeded: state >> 122)
        return folded >> rotation | folded << ((64 &- rotation) & 63)
    }

    /// `Generator.random()`: a double uniform on [0, 1) from the output's top 53 bits.
    public mutating func nextDouble() -> Double {
        Double(nextUInt64() >> 11) * (1.0 / 9_007_199_254_740_992.0)
    }
}

/// numpy's `SeedSequence` for one non-negative integer seed and no spawn key: the seed as little-endian 32-bit
/// words hashed into a pool of four, then the pool hashed out into the words a bit generator asks for.
struct SeedSequence {
    private static let initA: UInt32 = 0x43b0_d7e5
    private static let multA: UInt32 = 0x931e_8875
    private static let initB: UInt32 = 0x8b51_f9dd
    private static let multB: UInt32 = 0x58f3_8ded
    private static let mixMultL: UInt32 = 0xca01_f9dd
    private static let mixMultR: UInt32 = 0x4973_f715
    private static let poolSize = 4

    private(set) var pool = [UInt32](repeating: 0, count: 4)

    init(entropy: UInt64) {
        // _coerce_to_uint32_array: the integer's 32-bit words, least significant first, at least one
        let entropyWords: [UInt32] =
            entropy >> 32 == 0 ? [UInt32(entropy)] : [UInt32(truncatingIfNeeded: entropy), UInt32(entropy >> 32)]
        var hashConst = Self.initA
        func hashmix(_ value: UInt32) -> UInt32 {
            var value = value ^ hashConst
            hashConst = hashConst &* Self.multA
            value = value &* hashConst
            return value ^ (value >> 16)
        }
        func mix(_ x: UInt32, _ y: UInt32) -> UInt32 {
            let result = Self.mixMultL &* x &- Self.mixMultR &* y
            return result ^ (result >> 16)
        }
        for i in 0..<Self.poolSize {
            pool[i] = hashmix(i < entropyWords.count ? entropyWords[i] : 0)
        }
        for source in 0..<Self.poolSize {
            for destination in 0..<Self.poolSize where source != destination {
                pool[destination] = mix(pool[destination], hashmix(pool[source]))
            }
        }
        // entropy words past the pool (none for a 64-bit seed: at most two words) would be mixed in here
    }

    /// `generate_state(n, np.uint64)`: 2n 32-bit words, paired little-endian into n 64-bit ones.
    func generateState(words64 count: Int) -> [UInt64] {
        var hashConst = Self.initB
        var words = [UInt32]()
        for i in 0..<(2 * count) {
            var value = pool[i % Self.poolSize] ^ hashConst
            hashConst = hashConst &* Self.multB
            value = value &* hashConst
            words.append(value ^ (value >> 16))
        }
        return (0..<count).map { UInt64(words[2 * $0]) | UInt64(words[2 * $0 + 1]) << 32 }
    }
}
