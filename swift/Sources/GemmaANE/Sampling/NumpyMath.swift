/// The few numpy reductions the Python sampler's arithmetic goes through, in numpy's own order of operations, so
/// that the probabilities (and so the draws) come out bit for bit as the Python runtime's.
enum NumpyMath {
    /// `np.sum` of float64 values: numpy's pairwise summation (blocks of up to 128 summed in eight interleaved
    /// accumulators, larger ranges halved at a multiple of eight), added to the reduction's identity 0.
    static func sum(_ values: UnsafeBufferPointer<Double>) -> Double {
        guard let base = values.baseAddress else { return 0 }
        return 0.0 + pairwise(base, values.count)
    }

    static func sum(_ values: [Double]) -> Double {
        values.withUnsafeBufferPointer { sum($0) }
    }

    private static func pairwise(_ a: UnsafePointer<Double>, _ n: Int) -> Double {
        if n < 8 {
            var result = 0.0
            for i in 0..<n { result += a[i] }
            return result
        }
        if n <= 128 {
            var r0 = a[0], r1 = a[1], r2 = a[2], r3 = a[3], r4 = a[4], r5 = a[5], r6 = a[6], r7 = a[7]
            var i = 8
            while i < n - n % 8 {
                r0 += a[i]
                r1 += a[i + 1]
                r2 += a[i + 2]
                r3 += a[i + 3]
                r4 += a[i + 4]
                r5 += a[i + 5]
                r6 += a[i + 6]
                r7 += a[i + 7]
                i += 8
            }
            var result = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
            while i < n {
                result += a[i]
                i += 1
            }
            return result
        }
        var half = n / 2
        half -= half % 8
        return pairwise(a, half) + pairwise(a + half, n - half)
    }

    /// `np.cumsum`: a running sum, left to right.
    static func cumsum(_ values: [Double]) -> [Double] {
        var out = [Double](repeating: 0, count: values.count)
        var running = 0.0
        for i in values.indices {
            running += values[i]
            out[i] = running
        }
        return out
    }

    /// `np.searchsorted(sorted, key, side="left")`: the first index whose value is not below `key`.
    static func searchsortedLeft(_ sorted: [Double], _ key: Double) -> Int {
        var lo = 0, hi = sorted.count
        while lo < hi {
            let mid = (lo + hi) / 2
            if sorted[mid] < key { lo = mid + 1 } else { hi = mid }
        }
        return lo
    }

    /// `np.searchsorted(sorted, key, side="right")`: the first index whose value is above `key`.
    static func searchsortedRight(_ sorted: [Double], _ key: Double) -> Int {
        var lo = 0, hi = sorted.count
        while lo < hi {
            let mid = (lo + hi) / 2
            if sorted[mid] <= key { lo = mid + 1 } else { hi = mid }
        }
        return lo
    }

    /// Indices of the `n` largest values, largest first, ties by lower index (the Python `top_indices`). A strided
    /// sample gives a threshold that keeps a few hundred candidates, so the vocabulary is never sorted whole.
    static func topIndices(_ x: UnsafeBufferPointer<Float>, _ n: Int) -> [Int] {
        let count = x.count
        let n = min(n, count)
        guard n > 0 else { return [] }
        var candidates: [Int]
        if let threshold = sampledThreshold(x, n) {
            candidates = []
            candidates.reserveCapacity(4 * n + 256)
            for i in 0..<count where x[i] >= threshold { candidates.append(i) }
            if candidates.count < n || candidates.count > 64 * n + 4096 {
                candidates = atLeast(x, nthLargest(x, n))
            }
        } else {
            candidates = atLeast(x, nthLargest(x, n))
        }
        candidates.sort { x[$0] > x[$1] || (x[$0] == x[$1] && $0 < $1) }
        return Array(candidates.prefix(n))
    }

    /// A value at most the n-th largest, from every 64th value (nil for short rows, where a pass is cheap).
    private static func sampledThreshold(_ x: UnsafeBufferPointer<Float>, _ n: Int) -> Float? {
        guard x.count > 16384 else { return nil }
        var sample = stride(from: 0, to: x.count, by: 64).map { x[$0] }
        let k = min(sample.count - 1, n / 64 + 8)
        sample.sort(by: >)
        return sample[k].isNaN ? nil : sample[k]
    }

    private static func atLeast(_ x: UnsafeBufferPointer<Float>, _ threshold: Float) -> [Int] {
        var out = [Int]()
        for i in 0..<x.count where x[i] >= threshold { out.append(i) }
        return out
    }

    /// The n-th largest value by quickselect on a copy (the rare case the sampled threshold misses: a row mostly
    /// at one value, as a ban-heavy bias leaves it).
    private static func nthLargest(_ x: UnsafeBufferPointer<Float>, _ n: Int) -> Float {
        // NaN orders against nothing: left out, so a row of them leaves no candidate (the draw refuses it)
        var values = x.filter { !$0.isNaN }
        guard !values.isEmpty else { return .nan }
        var lo = 0, hi = values.count - 1
        let target = min(n, values.count) - 1  // index in descending order
        while lo < hi {
            let pivot = values[(lo + hi) / 2]
            var i = lo, j = hi
            while i <= j {
                while values[i] > pivot { i += 1 }
                while values[j] < pivot { j -= 1 }
                if i <= j {
                    values.swapAt(i, j)
                    i += 1
                    j -= 1
                }
            }
            if target <= j { hi = j } else if target >= i { lo = i } else { break }
        }
        return values[target]
    }
}
